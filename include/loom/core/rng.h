#pragma once
// Deterministic seeds derived from names and indices. Everything random in loom is drawn from
// a generator seeded by one of these, so values depend on (seed, name / step / index) and never
// on the parallel layout, the thread count or the order in which things are created.
#include <ATen/core/Generator.h>

#include <cstdint>
#include <initializer_list>
#include <string_view>

namespace loom::core {

// FNV-1a over the bytes: stable across platforms and runs (std::hash is not).
uint64_t stable_hash(std::string_view text);

// splitmix64 chain over the values: a well-mixed 64-bit seed from several integers.
uint64_t mix_seed(std::initializer_list<uint64_t> values);

// A CPU generator seeded with `seed`.
at::Generator make_generator(uint64_t seed);

}  // namespace loom::core
