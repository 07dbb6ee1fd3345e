#pragma once
// Quantized all-reduce with error feedback: int8 (blockwise codes and scales, ops/quantize.h) and
// onebit (a sign bit per value and a scale per block, ops/sign_pack.h). Both reduce a bucket as an
// all-to-all and an all-gather of compressed chunks, so the sum is compressed once per hop instead
// of once per rank (the scheme of 1-bit Adam and ZeRO++'s quantized collectives):
//   1. every rank adds its carried error to its gradient, compresses it (what the compression
//      loses becomes its new error) and sends chunk j to rank j (all-to-all);
//   2. rank j decompresses the R chunks it received, averages them, adds its own carried error
//      for that segment ("server" error), compresses the mean and all-gathers it.
// Over steps the results sum to the true mean gradients minus the carried errors, which stay
// bounded. Bytes a rank sends per bucket (dist::wire_bytes): 2 (R - 1) P for chunks of P bytes
// per segment of S = segment_numel(n, R) values, against an fp32 all-reduce's 2 (R - 1) / R x 4 n:
// int8 P = S (1 + 4/256), about 3.94 times fewer; onebit P = S (1/8 + 4/1024), about 31.0 times
// fewer (docs/compression.md). The error buffers are per rank and per bucket: training state,
// saved in each rank's checkpoint file ("b<index>/error", "b<index>/server_error").
// Under ZeRO (reduce_scatter) only step 1 runs, on the shard layout: each of the R shards is
// padded to a multiple of the block and compressed as its own chunk, the receiver averages the R
// chunks of its shard into fp32, and no second compression (nor server error) follows. Bytes:
// (R - 1) P per bucket against a reduce-scatter's (R - 1) x 4 x shard; the error is
// "b<index>/scatter_error".
#include <cstdint>
#include <map>
#include <string>

#include "loom/core/option_spec.h"
#include "loom/parallel/data/comm_hook.h"

namespace loom::parallel::data {

class QuantizedAllReduceHook : public CommHook {
 public:
  // `block`: how many values share a scale; each segment is a multiple of it.
  QuantizedAllReduceHook(std::string name, int64_t block);
  std::string name() const override { return name_; }
  dist::WorkPtr start(GradBucket& bucket, dist::Communicator& comm) override;
  void finish(GradBucket& bucket, dist::Communicator& comm) override;
  bool carries_state() const override { return true; }
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  // The error kMean (its padding past the bucket is zero on every rank), the server segments
  // kConcat (joined they are the group's second-hop error over the whole bucket); the next
  // reduction lays both out for its number of ranks. Under ZeRO the reduce-scatter's error kMean,
  // laid out anew for the new shards (lay_out_resharded with ZeRO's padded bucket size).
  StateReshard reshard_rule(const std::string& key) const override;
  void load_resharded_state(const std::map<std::string, at::Tensor>& state) override;
  void lay_out_resharded(int64_t index, int64_t numel, int64_t rank, int64_t ranks) override;
  // "owed": the mean error plus the joined server error, or the reduce-scatter's mean error with
  // each shard's block padding dropped. Taken back as a mean error (no server error), laid out
  // by lay_out_resharded.
  std::map<std::string, at::Tensor> group_values(
      const std::map<std::string, at::Tensor>& group,
      const std::map<int64_t, BucketShape>& buckets) const override;
  void load_group_values(const std::map<std::string, at::Tensor>& values,
                         bool reduce_scatter) override;
  bool reduces_scatter() const override { return true; }
  dist::WorkPtr start_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                                     dist::Communicator& comm) override;
  void finish_reduce_scatter(GradBucket& bucket, const at::Tensor& recv,
                             dist::Communicator& comm) override;

  int64_t block() const { return block_; }
  // Each rank's segment of a bucket of `numel` values over `ranks` ranks: a multiple of block()
  // (the bucket is padded with zeros to ranks * segment).
  int64_t segment_numel(int64_t numel, int64_t ranks) const;
  // Bytes of one compressed chunk of `segment` values.
  virtual int64_t chunk_bytes(int64_t segment) const = 0;
  // The errors carried for bucket `index` (empty before its first reduction): this rank's whole
  // padded bucket, and its segment of the mean.
  at::Tensor error(int64_t index) const;
  at::Tensor server_error(int64_t index) const;
  // The reduce-scatter's error of bucket `index`: float32 [ranks * padded shard], or empty.
  at::Tensor scatter_error(int64_t index) const;

 protected:
  // Compresses x + error into `chunks` (uint8 [rows, chunk_bytes(segment)], row r holding values
  // [r segment, (r + 1) segment) of x: float32 [rows segment]) and leaves what that lost in
  // `error` (updated in place).
  virtual void compress(const at::Tensor& x, at::Tensor& error, const at::Tensor& chunks) const = 0;
  // The values of `chunks` (uint8 [rows, chunk_bytes(segment)]): float32 [rows, segment].
  virtual at::Tensor decompress(const at::Tensor& chunks, int64_t segment) const = 0;

 private:
  struct State {
    int64_t ranks = 0, segment = 0;
    at::Tensor error, server_error;  // float32 [ranks * segment], [segment]
    at::Tensor send, recv;           // chunks in flight: uint8 [ranks, chunk bytes]
    // Restored from another number of ranks, until lay_out_resharded (or the next reduction) lays
    // them out: the mean error and the whole server error, each over the old ranks' padded
    // bucket.
    at::Tensor resharded_error, resharded_server_error;
  };
  struct ScatterState {
    int64_t ranks = 0, shard = 0, segment = 0;  // segment: the shard padded to the block
    at::Tensor error;                           // float32 [ranks * segment]
    at::Tensor send, recv;
    // Restored from another number of ranks, until laid out: the old ranks' mean error in bucket
    // order (the shards joined, without their padding to the block).
    at::Tensor resharded_error;
  };
  // (Re)allocates `s` for a bucket of `numel` values reduced as `rank` of `ranks`: zero errors,
  // or what a reshard left in it.
  void lay_out(State& s, int64_t numel, int64_t rank, int64_t ranks,
               const at::TensorOptions& options) const;
  // n rounded up to a multiple of the block.
  int64_t to_block(int64_t n) const { return (n + block_ - 1) / block_ * block_; }
  // The same for ZeRO's reduce-scatter into `ranks` shards of `shard` values.
  void lay_out_scatter(ScatterState& s, int64_t ranks, int64_t shard,
                       const at::TensorOptions& options) const;
  std::string name_;
  int64_t block_;
  std::map<int64_t, State> state_;                 // by bucket index
  std::map<int64_t, ScatterState> scatter_state_;  // by bucket index
};

// --comm-hook int8: codes of one byte, an fp32 scale per 256 values (the block's largest
// magnitude / 127); a value's error is at most half a step (ops/quantize.h).
class Int8CompressHook : public QuantizedAllReduceHook {
 public:
  Int8CompressHook();
  int64_t chunk_bytes(int64_t segment) const override;

 protected:
  void compress(const at::Tensor& x, at::Tensor& error, const at::Tensor& chunks) const override;
  at::Tensor decompress(const at::Tensor& chunks, int64_t segment) const override;
};

// --comm-hook onebit: a sign bit per value and an fp32 scale per 1024 values (the block's mean
// magnitude), 31 times fewer bytes than fp32 (ops/sign_pack.h). Every value moves by the block's
// mean magnitude, so the error it carries is of the size of the gradient itself: it trains close
// to the uncompressed run only with AdamW's variance frozen after a dense warm-up
// (--freeze-variance-after, --comm-hook onebit:warmup=N; 1-bit Adam, docs/compression.md).
class OneBitCompressHook : public QuantizedAllReduceHook {
 public:
  OneBitCompressHook();
  int64_t chunk_bytes(int64_t segment) const override;

 protected:
  void compress(const at::Tensor& x, at::Tensor& error, const at::Tensor& chunks) const override;
  at::Tensor decompress(const at::Tensor& chunks, int64_t segment) const override;
};

}  // namespace loom::parallel::data
