// A communication hook of a user's own, with an option: each gradient bucket is averaged in
// fp16 (half the bytes of fp32 on the wire). Registered in the program that links this file, it
// is chosen like a built-in one: --comm-hook fp16 or --comm-hook fp16:prescale=false. Being
// constructible from the OptionSpec, it reads and checks its own options; an unknown one is an
// error before any collective (docs/distributed.md, "Data parallelism").
#include <loom/loom.h>

#include <ATen/ATen.h>

namespace {

namespace pd = loom::parallel::data;

class Fp16Hook : public pd::CommHook {
 public:
  explicit Fp16Hook(const loom::core::OptionSpec& spec) {
    spec.check_keys({"prescale"});
    // Dividing by the ranks before the sum keeps it in fp16's range whatever their number.
    prescale_ = spec.get_bool("prescale", true);
  }
  std::string name() const override { return "fp16"; }
  loom::dist::WorkPtr start(pd::GradBucket& bucket, loom::dist::Communicator& comm) override {
    const auto scaled =
        prescale_ ? bucket.buffer / static_cast<double>(comm.size()) : bucket.buffer;
    bucket.scratch = scaled.to(at::kHalf);
    return comm.all_reduce_async(bucket.scratch, loom::dist::ReduceOp::Sum);
  }
  void finish(pd::GradBucket& bucket, loom::dist::Communicator& comm) override {
    bucket.buffer.copy_(bucket.scratch);
    if (!prescale_) bucket.buffer.div_(static_cast<double>(comm.size()));
    bucket.scratch = at::Tensor();
  }

 private:
  bool prescale_ = true;
};

}  // namespace

LOOM_REGISTER_COMM_HOOK(Fp16Hook, "fp16");
