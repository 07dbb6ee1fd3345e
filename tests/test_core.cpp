#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "crash_report.h"
#include "loom/core/files.h"
#include "loom/core/format.h"
#include "loom/core/json.h"
#include "loom/core/memory.h"
#include "loom/core/preemption.h"
#include "loom/core/rng.h"
#include "loom/core/safetensors.h"
#include "test_util.h"

using loom::testing::contains;
using loom::testing::error_of;
using loom::testing::TempDir;
namespace core = loom::core;

TEST(Core, Crc32MatchesTheStandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(core::crc32(s.data(), s.size()), 0xCBF43926U);
  // Continuing a CRC over two halves equals one pass.
  EXPECT_EQ(core::crc32(s.data() + 4, 5, core::crc32(s.data(), 4)), 0xCBF43926U);
}

TEST(Core, StableHashAndMixSeedAreDeterministicAndSpread) {
  EXPECT_EQ(core::stable_hash("transformer.wte.weight"),
            core::stable_hash("transformer.wte.weight"));
  EXPECT_NE(core::stable_hash("a"), core::stable_hash("b"));
  EXPECT_EQ(core::stable_hash(""), 1469598103934665603ULL);  // FNV-1a offset basis
  EXPECT_EQ(core::mix_seed({1, 2, 3}), core::mix_seed({1, 2, 3}));
  EXPECT_NE(core::mix_seed({1, 2, 3}), core::mix_seed({1, 3, 2}));
}

TEST(Core, GeneratorWithSameSeedGivesSameValues) {
  auto a = at::empty({64}).normal_(0, 1, core::make_generator(7));
  auto b = at::empty({64}).normal_(0, 1, core::make_generator(7));
  auto c = at::empty({64}).normal_(0, 1, core::make_generator(8));
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_FALSE(at::equal(a, c));
}

TEST(Core, SafetensorsRoundTripsEveryDtype) {
  TempDir dir;
  core::NamedTensors tensors;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
    tensors.emplace_back(std::string("t_") + c10::toString(dtype), at::randn({3, 5}).to(dtype));
  tensors.emplace_back("ints", at::arange(10, at::kLong).view({2, 5}));
  tensors.emplace_back("i32", at::arange(7, at::kInt));
  tensors.emplace_back("bytes", at::arange(9, at::kByte));
  tensors.emplace_back("scalar", at::tensor(3.5));
  tensors.emplace_back("empty", at::empty({0, 4}));
  tensors.emplace_back("noncontiguous", at::randn({4, 6}).t());
  core::save_safetensors(dir / "x.safetensors", tensors, {{"format", "pt"}, {"k", "v"}});
  auto back = core::load_safetensors(dir / "x.safetensors");
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(back.tensors.count(name)) << name;
    EXPECT_EQ(back.tensors[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(back.tensors[name], t.contiguous())) << name;
  }
  EXPECT_EQ(back.metadata.at("k"), "v");
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors.tmp"));
}

TEST(Core, SafetensorsReportsTruncationAndGarbage) {
  TempDir dir;
  core::save_safetensors(dir / "x.safetensors", {{"w", at::randn({100})}});
  std::filesystem::resize_file(dir / "x.safetensors",
                               std::filesystem::file_size(dir / "x.safetensors") - 10);
  EXPECT_NE(
      error_of([&] { core::load_safetensors(dir / "x.safetensors"); }).find("outside the file"),
      std::string::npos);
  std::ofstream(dir / "bad.safetensors") << "not a safetensors file at all";
  EXPECT_NE(
      error_of([&] { core::load_safetensors(dir / "bad.safetensors"); }).find("bad.safetensors"),
      std::string::npos);
  EXPECT_NE(error_of([&] { core::load_safetensors(dir / "missing.safetensors"); }).find("missing"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] {
        core::save_safetensors(dir / "dup.safetensors", {{"a", at::ones(1)}, {"a", at::ones(1)}});
      }).find("appears twice"),
      std::string::npos);
}

// Header numbers that are not non-negative integers are refused with the tensor's name: a float
// (1e20: nlohmann would cast it, undefined behaviour, found by fuzz.safetensors), a negative
// value, something that is not a list.
TEST(Core, SafetensorsRefusesShapesAndOffsetsThatAreNotIntegers) {
  TempDir dir;
  auto write_file = [&](const std::string& header) {
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    std::ofstream(dir / "h.safetensors", std::ios::binary)
        << bytes << header << std::string(8, '\0');
  };
  auto write = [&](const std::string& header) {
    write_file(header);
    return error_of([&] { core::load_safetensors(dir / "h.safetensors"); });
  };
  auto msg = write(R"({"w":{"dtype":"F32","shape":[4.6e20],"data_offsets":[0,8]}})");
  EXPECT_TRUE(contains(msg, "tensor 'w' shape is [4.6e+20]: 4.6e+20 is not an integer in [0, "))
      << msg;
  msg = write(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})");
  EXPECT_TRUE(contains(msg, "data_offsets") && contains(msg, "8.5 is not an integer")) << msg;
  msg = write(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})");
  EXPECT_TRUE(contains(msg, "-2 is not an integer in [0, ")) << msg;
  msg = write(R"({"w":{"dtype":"F32","shape":7,"data_offsets":[0,8]}})");
  EXPECT_TRUE(contains(msg, "must be a list of integers")) << msg;
  msg = write(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})");
  EXPECT_TRUE(contains(msg, "has 3 entries")) << msg;
  write_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})");
  EXPECT_EQ(core::load_safetensors(dir / "h.safetensors").tensors.at("w").sizes(),
            at::IntArrayRef({2}));
}

// JSON integers are read only from JSON integers in the caller's range; a float (which nlohmann
// would cast, undefined when out of range), a string or an integer outside the range is an error
// that names the value and the range, and a long value is cut short in the message.
TEST(Core, JsonIntegersComeOnlyFromJsonIntegersInRange) {
  using nlohmann::json;
  EXPECT_EQ(core::json_int64(json(-5), "x"), -5);
  EXPECT_EQ(core::json_int64(json(9223372036854775807LL), "x"), INT64_MAX);
  EXPECT_EQ(core::json_int64(json(3), "x", 3, 3), 3);
  for (const auto& bad : {json(1e300), json(2.5), json(3.0), json("7"), json(true), json(nullptr),
                          json(9223372036854775808ULL)}) {
    const auto msg = error_of([&] { core::json_int64(bad, "'f.json': n"); });
    EXPECT_TRUE(contains(msg, "'f.json': n is " + bad.dump() + ": it must be an integer in ["))
        << msg;
  }
  EXPECT_TRUE(contains(error_of([&] { core::json_int64(json(4), "n", 0, 3); }),
                       "n is 4: it must be an integer in [0, 3]"));
  EXPECT_EQ(core::json_int64_list(json::parse("[0, 7, 2]"), "s", 0),
            (std::vector<int64_t>{0, 7, 2}));
  EXPECT_TRUE(core::json_int64_list(json::array(), "s").empty());
  EXPECT_TRUE(contains(error_of([&] { core::json_int64_list(json::parse("[1, -1]"), "s", 0); }),
                       "s is [1,-1]: -1 is not an integer in [0, 9223372036854775807]"));
  EXPECT_TRUE(contains(error_of([&] { core::json_int64_list(json(1), "s"); }),
                       "s is 1: it must be a list of integers"));
  const auto msg = error_of([&] { core::json_int64(json(std::string(100000, 'a')), "n"); });
  EXPECT_LT(msg.size(), 300U) << msg.size();
}

// check_json_like compares types field by field against a struct's defaults: integers must be
// integers that fit (unsigned ones non-negative), floats any number, lists element by element;
// keys on one side only are left alone, and a null default says nothing.
TEST(Core, JsonValuesAreCheckedAgainstTheTypesOfTheirDefaults) {
  using nlohmann::json;
  const json like = {{"n", int64_t{1}},
                     {"seed", uint64_t{2}},
                     {"lr", 0.5},
                     {"name", "a"},
                     {"on", false},
                     {"ids", {int64_t{1}}},
                     {"sub", {{"k", int64_t{0}}}},
                     {"any", nullptr},
                     {"names", json::array()}};
  json good = {{"n", -4},
               {"seed", 7},
               {"lr", 3},
               {"name", "b"},
               {"on", true},
               {"ids", json::array()},
               {"sub", {{"k", 5}, {"extra", "x"}}},
               {"any", 1.5},
               {"names", {1, "x"}},
               {"unknown", 1e300}};
  core::check_json_like(good, like, "cfg");
  const std::pair<const char*, json> bad[] = {{"n", 1.5},
                                              {"n", 1e300},
                                              {"n", 9223372036854775808ULL},
                                              {"seed", -1},
                                              {"seed", 2.0},
                                              {"lr", "0.5"},
                                              {"name", 1},
                                              {"on", 0},
                                              {"ids", {1, 2.5}},
                                              {"sub", {{"k", 0.5}}},
                                              {"sub", 3}};
  for (const auto& [key, value] : bad) {
    auto j = good;
    j[key] = value;
    const auto msg = error_of([&] { core::check_json_like(j, like, "cfg"); });
    EXPECT_TRUE(contains(msg, std::string("cfg.") + key) && contains(msg, "it must be"))
        << key << " = " << value.dump() << ": " << msg;
  }
  EXPECT_TRUE(contains(error_of([&] {
                         auto j = good;
                         j["ids"] = {1, 2.5};
                         core::check_json_like(j, like, "cfg");
                       }),
                       "cfg.ids[1] is 2.5: it must be an integer that fits 64 bits"));
}

// The reader reads one tensor's bytes when asked, from a file whose other tensors it never
// loads; an unknown name, and a file cut short after the reader opened it, are errors naming it.
TEST(Core, SafetensorsReaderReadsOneTensorAtATime) {
  TempDir dir;
  const auto a = at::randn({3, 4}), b = at::arange(6, at::kLong), c = at::randn({2, 2}, at::kHalf);
  core::save_safetensors(dir / "x.safetensors", {{"a", a}, {"b", b}, {"c", c}}, {{"k", "v"}});
  const core::SafetensorsReader reader(dir / "x.safetensors");
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(reader.contains("b"));
  EXPECT_FALSE(reader.contains("d"));
  EXPECT_EQ(reader.metadata().at("k"), "v");
  EXPECT_TRUE(at::equal(reader.read("c"), c));
  EXPECT_TRUE(at::equal(reader.read("a"), a));
  EXPECT_TRUE(at::equal(reader.read("b"), b));
  auto msg = error_of([&] { reader.read("d"); });
  EXPECT_NE(msg.find("holds no tensor 'd'"), std::string::npos) << msg;
  std::filesystem::resize_file(dir / "x.safetensors",
                               std::filesystem::file_size(dir / "x.safetensors") - 4);
  EXPECT_TRUE(at::equal(reader.read("a"), a));  // before the cut
  msg = error_of([&] { reader.read("c"); });
  EXPECT_NE(msg.find("short read of tensor 'c'"), std::string::npos) << msg;
}

// The writer takes tensors in any order and makes the file appear only when finished; what it
// was not declared, or declared otherwise, is refused naming it; unfinished, it leaves nothing.
TEST(Core, SafetensorsWriterWritesTensorsInAnyOrder) {
  TempDir dir;
  const auto a = at::randn({3, 4}), b = at::arange(6, at::kLong);
  {
    core::SafetensorsWriter writer(
        dir / "w.safetensors", {{"a", at::kFloat, {3, 4}}, {"b", at::kLong, {6}}}, {{"k", "v"}});
    writer.write("b", b);
    EXPECT_FALSE(std::filesystem::exists(dir / "w.safetensors"));
    auto msg = error_of([&] { writer.write("c", b); });
    EXPECT_NE(msg.find("no tensor 'c' was declared"), std::string::npos) << msg;
    msg = error_of([&] { writer.write("b", b); });
    EXPECT_NE(msg.find("'b' is written twice"), std::string::npos) << msg;
    msg = error_of([&] { writer.write("a", at::randn({4, 3})); });
    EXPECT_NE(msg.find("tensor 'a' is Float [4, 3] but was declared Float [3, 4]"),
              std::string::npos)
        << msg;
    msg = error_of([&] { writer.finish(); });
    EXPECT_NE(msg.find("tensor 'a' was never written"), std::string::npos) << msg;
    writer.write("a", a.t().contiguous().t());  // any layout
    writer.finish();
  }
  const auto back = core::load_safetensors(dir / "w.safetensors");
  EXPECT_TRUE(at::equal(back.tensors.at("a"), a));
  EXPECT_TRUE(at::equal(back.tensors.at("b"), b));
  EXPECT_EQ(back.metadata.at("k"), "v");
  {
    core::SafetensorsWriter unfinished(dir / "u.safetensors", {{"a", at::kFloat, {3, 4}}});
    unfinished.write("a", a);
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "u.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir / "u.safetensors.tmp"));
}

TEST(Core, AtomicWriteReplacesWholeFile) {
  TempDir dir;
  core::write_file_atomic(dir / "f.txt", "first version");
  core::write_file_atomic(dir / "f.txt", "second");
  EXPECT_EQ(core::read_file(dir / "f.txt"), "second");
  EXPECT_FALSE(std::filesystem::exists(dir / "f.txt.tmp"));
}

TEST(Core, EnsureWritableDirNamesTheProblem) {
  TempDir dir;
  core::ensure_writable_dir(dir / "a" / "b");
  EXPECT_TRUE(std::filesystem::is_directory(dir / "a" / "b"));
  std::ofstream(dir / "file") << "x";
  EXPECT_NE(error_of([&] { core::ensure_writable_dir(dir / "file"); }).find("file"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              core::ensure_writable_dir("/proc/loom-cannot-be-here");
            }).find("/proc/loom-cannot-be-here"),
            std::string::npos);
}

// core::remove_tree (loom's remove_all, which the torch wheel's exported copy cannot be trusted
// with): a tree of files, directories and a link is removed and counted; the link is removed,
// its target kept; a missing path removes nothing without an error; a trailing separator names
// the directory; ".", ".." and "" are refused.
TEST(Core, RemoveTreeRemovesEverythingBelowAndNoLinkTarget) {
  TempDir dir;
  const auto tree = dir / "tree";
  std::filesystem::create_directories(tree / "a" / "b");
  std::filesystem::create_directories(dir / "kept");
  std::ofstream(dir / "kept" / "target.txt") << "stays";
  std::ofstream(tree / "top.txt") << "x";
  std::ofstream(tree / "a" / "b" / "deep.txt") << "y";
  std::filesystem::create_directory_symlink(dir / "kept", tree / "a" / "link");
  std::error_code ec;
  // tree, top.txt, a, a/b, a/b/deep.txt, a/link: 6 entries.
  EXPECT_EQ(core::remove_tree(tree, ec), 6u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(std::filesystem::exists(tree));
  EXPECT_EQ(core::read_file(dir / "kept" / "target.txt"), "stays");

  EXPECT_EQ(core::remove_tree(dir / "missing", ec), 0u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_EQ(core::remove_tree(dir / "missing" / "deeper", ec), 0u);
  EXPECT_FALSE(ec) << ec.message();

  std::filesystem::create_directories(dir / "slash" / "x");
  EXPECT_EQ(core::remove_tree((dir / "slash").string() + "/", ec), 2u);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_FALSE(std::filesystem::exists(dir / "slash"));

  EXPECT_EQ(core::remove_tree(dir / "kept" / "target.txt", ec), 1u);  // a file alone
  EXPECT_FALSE(std::filesystem::exists(dir / "kept" / "target.txt"));
  for (const char* refused : {"", ".", ".."}) {
    EXPECT_EQ(core::remove_tree(refused, ec), 0u);
    EXPECT_EQ(ec, std::errc::invalid_argument) << "'" << refused << "'";
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "kept"));
}

namespace {

constexpr int64_t kMiB = 1024 * 1024;

// Lifts the memory cap at scope exit, so a failing test does not leave it on for the rest.
struct MemoryCapGuard {
  MemoryCapGuard() { core::install_memory_tracking(); }
  ~MemoryCapGuard() { core::set_memory_cap(0); }
  MemoryCapGuard(const MemoryCapGuard&) = delete;
  MemoryCapGuard& operator=(const MemoryCapGuard&) = delete;
};

}  // namespace

TEST(MemoryFormat, BytesUseBinaryUnits) {
  EXPECT_EQ(core::format_bytes(0), "0 B");
  EXPECT_EQ(core::format_bytes(512), "512 B");
  EXPECT_EQ(core::format_bytes(1024), "1.0 KiB");
  EXPECT_EQ(core::format_bytes(3 * kMiB / 2), "1.5 MiB");
  EXPECT_EQ(core::format_bytes(2048 * kMiB), "2.0 GiB");
  EXPECT_EQ(core::format_bytes(-4 * kMiB), "-4.0 MiB");
}

TEST(MemoryTracking, CountsATensorUntilItIsFreed) {
  core::install_memory_tracking();
  core::install_memory_tracking();  // idempotent
  ASSERT_TRUE(core::memory_tracking_installed());
  const auto before = core::memory_counters();
  auto tensor = at::empty({kMiB / 4}, at::kFloat);
  const auto holding = core::memory_counters();
  EXPECT_GE(holding.current_bytes - before.current_bytes, kMiB);
  EXPECT_GE(holding.allocations - before.allocations, 1);
  EXPECT_GE(holding.peak_bytes, holding.current_bytes);
  tensor.reset();
  const auto after = core::memory_counters();
  EXPECT_LE(after.current_bytes, holding.current_bytes - kMiB);
}

TEST(MemoryTracking, PeakKeepsTheHighestUntilReset) {
  core::install_memory_tracking();
  core::reset_peak_memory();
  const auto start = core::memory_counters();
  EXPECT_EQ(start.peak_bytes, start.current_bytes);
  at::empty({2 * kMiB}, at::kByte).fill_(1);  // a temporary, freed at the end of the statement
  const auto after = core::memory_counters();
  EXPECT_GE(after.peak_bytes - start.current_bytes, 2 * kMiB);
  EXPECT_LT(after.current_bytes, after.peak_bytes);
  core::reset_peak_memory();
  const auto reset = core::memory_counters();
  EXPECT_LT(reset.peak_bytes - reset.current_bytes, kMiB);
}

TEST(MemoryTracking, RawAllocationsAndForeignFreesKeepTheCountRight) {
  core::install_memory_tracking();
  auto* allocator = c10::GetCPUAllocator();
  const auto before = core::memory_counters();
  // oneDNN allocates scratch memory with raw_allocate and frees it through whatever allocator is
  // current, so raw pointers must round-trip, including ones allocated before tracking began.
  void* raw = allocator->raw_allocate(kMiB);
  EXPECT_GE(core::memory_counters().current_bytes - before.current_bytes, kMiB);
  allocator->raw_deallocate(raw);
  void* foreign = c10::GetDefaultCPUAllocator()->raw_allocate(kMiB);
  allocator->raw_deallocate(foreign);
  EXPECT_LE(core::memory_counters().current_bytes, before.current_bytes);
  // A storage from the untracked allocator (as from before install) is not counted, and it
  // frees through its own deleter without touching the count.
  auto untracked = at::detail::empty_generic({kMiB}, c10::GetDefaultCPUAllocator(),
                                             c10::DispatchKeySet(c10::DispatchKey::CPU), at::kByte,
                                             std::nullopt);
  EXPECT_LE(core::memory_counters().current_bytes, before.current_bytes);
  untracked.reset();
  EXPECT_LE(core::memory_counters().current_bytes, before.current_bytes);
}

TEST(MemoryStorageBytes, CountsEachStorageOnce) {
  const auto matrix = at::empty({16, 16}, at::kFloat);  // 1024 bytes
  const auto other = at::empty({10}, at::kDouble);      // 80 bytes
  EXPECT_EQ(core::storage_bytes({matrix}), 1024);
  EXPECT_EQ(core::storage_bytes({matrix.slice(0, 0, 2)}), 1024);  // a view holds all of it
  EXPECT_EQ(core::storage_bytes({matrix, matrix.t(), matrix.view({256}), matrix[3], other}),
            1024 + 80);
  EXPECT_EQ(core::storage_bytes({at::Tensor(), at::empty({0, 4}), other}), 80);
  EXPECT_EQ(core::storage_bytes({}), 0);
}

TEST(MemoryCap, RefusesAnAllocationOverTheCapAndLeavesTheCountsAlone) {
  MemoryCapGuard guard;
  const auto start = core::memory_counters();
  core::set_memory_cap(start.current_bytes + kMiB, "--memory-cap-mb");
  EXPECT_EQ(core::memory_cap(), start.current_bytes + kMiB);
  auto small = at::empty({64 * 1024}, at::kByte);  // fits under the cap
  const auto before = core::memory_counters();
  std::string message;
  bool is_loom_error = false;
  try {
    at::empty({kMiB}, at::kFloat);  // 4 MiB
  } catch (const std::exception& e) {
    message = e.what();
    is_loom_error = dynamic_cast<const loom::Error*>(&e) != nullptr;
  }
  EXPECT_TRUE(is_loom_error) << message;
  EXPECT_TRUE(loom::testing::contains(message, "loom memory cap")) << message;
  EXPECT_TRUE(loom::testing::contains(message, "allocating 4.0 MiB")) << message;
  EXPECT_TRUE(loom::testing::contains(message, "--memory-cap-mb")) << message;
  const auto after = core::memory_counters();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.peak_bytes, before.peak_bytes);
  core::set_memory_cap(0);
  EXPECT_EQ(core::memory_cap(), 0);
  EXPECT_EQ(at::empty({kMiB}, at::kFloat).numel(), kMiB);
}

TEST(MemoryCap, TrainingContinuesAfterAStepThatHitTheCap) {
  MemoryCapGuard guard;
  const auto weight = at::randn({64, 64}).set_requires_grad(true);
  const auto inputs = at::randn({512, 64});
  const auto step = [&](at::ScalarType dtype) {
    weight.mutable_grad() = at::Tensor();
    at::matmul(inputs.to(dtype), weight.to(dtype)).to(at::kFloat).square().sum().backward();
  };
  core::set_memory_cap(core::memory_counters().current_bytes + 4096);
  EXPECT_THROW(step(at::kFloat), std::exception);  // the 128 KiB product does not fit
  core::set_memory_cap(0);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {  // bf16 matmuls may go through oneDNN
    step(dtype);
    ASSERT_TRUE(weight.grad().defined());
    EXPECT_TRUE(weight.grad().isfinite().all().item<bool>());
  }
}

TEST(MemoryCounters, RefuseDevicesTheyCannotMeasure) {
  const auto message = error_of([] { core::memory_counters(at::Device(at::kMeta)); });
  EXPECT_TRUE(loom::testing::contains(message, "meta")) << message;
}

TEST(MemoryReport, DescribeAndJsonNameEveryField) {
  core::MemoryReport report;
  report.parameters = 12 * kMiB;
  report.gradients = 12 * kMiB;
  report.optimizer = 24 * kMiB;
  report.peak_activations = 3 * kMiB / 2;
  report.current_total = 48 * kMiB;
  report.peak_total = 50 * kMiB;
  report.device = "cpu";
  const auto line = report.describe();
  for (const char* part :
       {"memory (cpu)", "parameters 12.0 MiB", "gradients 12.0 MiB", "optimizer 24.0 MiB",
        "peak activations 1.5 MiB", "allocated now 48.0 MiB", "(peak 50.0 MiB)"})
    EXPECT_TRUE(loom::testing::contains(line, part)) << part << " not in: " << line;
  const auto json = report.to_json();
  EXPECT_EQ(json.at("device"), "cpu");
  EXPECT_EQ(json.at("parameters_bytes"), 12 * kMiB);
  EXPECT_EQ(json.at("gradients_bytes"), 12 * kMiB);
  EXPECT_EQ(json.at("optimizer_bytes"), 24 * kMiB);
  EXPECT_EQ(json.at("peak_activations_bytes"), 3 * kMiB / 2);
  EXPECT_EQ(json.at("current_bytes"), 48 * kMiB);
  EXPECT_EQ(json.at("peak_bytes"), 50 * kMiB);
}

TEST(Preemption, SignalNamesParseAndBadOnesAreNamed) {
  EXPECT_EQ(core::parse_preemption_signals("TERM,USR1"), (std::vector<int>{SIGTERM, SIGUSR1}));
  EXPECT_EQ(core::parse_preemption_signals("sigusr1, term ,usr1"),
            (std::vector<int>{SIGUSR1, SIGTERM}));
  EXPECT_TRUE(core::parse_preemption_signals("none").empty());
  EXPECT_TRUE(core::parse_preemption_signals("").empty());
  EXPECT_EQ(core::signal_name(SIGUSR1), "SIGUSR1");
  const auto msg = error_of([] { core::parse_preemption_signals("TERM,KILL"); });
  EXPECT_TRUE(loom::testing::contains(msg, "preemption signal 'KILL' in 'TERM,KILL' is not known"))
      << msg;
  EXPECT_TRUE(loom::testing::contains(msg, "TERM, USR1")) << msg;
}

// The watch records the first signal instead of dying, and puts back the previous handlers.
TEST(Preemption, WatchRecordsTheSignalAndRestoresThePreviousHandler) {
  static volatile std::sig_atomic_t previous_ran = 0;
  auto* const before = std::signal(SIGUSR2, [](int) { previous_ran = 1; });
  {
    core::PreemptionWatch watch({SIGUSR1, SIGUSR2});
    EXPECT_EQ(watch.received(), 0);
    std::raise(SIGUSR2);
    std::raise(SIGUSR1);
    EXPECT_EQ(watch.received(), SIGUSR2);  // the first one
    EXPECT_EQ(previous_ran, 0);
    const auto msg = error_of([] { core::PreemptionWatch second({SIGUSR1}); });
    EXPECT_TRUE(loom::testing::contains(msg, "already installed")) << msg;
  }
  std::raise(SIGUSR2);
  EXPECT_EQ(previous_ran, 1);
  std::signal(SIGUSR2, before);
  core::PreemptionWatch again({SIGUSR1});  // a new watch starts clear
  EXPECT_EQ(again.received(), 0);
}

// The test processes' crash report (tests/crash_report.h) names the caller of a call through a
// null pointer, where the program counter is 0 and an unwinder stops at once: the first GPU run
// crashed that way, and Open MPI's report showed one libc frame.
TEST(CrashReportDeathTest, ANullCallNamesItsCaller) {
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        loom::testing::install_crash_report();
        void (*volatile null_function)() = nullptr;
        null_function();
      },
      "loom: fatal signal 11 .*pc 0x0.*return address [^ ]*loom_tests\\+0x[0-9a-f]+");
#else
  GTEST_SKIP() << "the report reads x86-64 registers (and ASan reports on its own)";
#endif
}
