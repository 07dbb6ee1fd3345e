#include "loom/core/rng.h"

#include <ATen/CPUGeneratorImpl.h>

namespace loom::core {

uint64_t stable_hash(std::string_view text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
}  // namespace

uint64_t mix_seed(std::initializer_list<uint64_t> values) {
  uint64_t h = 0x6A09E667F3BCC909ULL;
  for (uint64_t v : values) h = splitmix64(h ^ splitmix64(v));
  return h;
}

at::Generator make_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

}  // namespace loom::core
