#pragma once
// Cross-layer parameter sharing: one block's weights used at several depths (ALBERT-style
// "all", Takase & Kiyono's "cycle" and "sequence" orders, or an explicit list). A model stores
// each shared block once, under the name of the first layer that uses it (its owner), so a
// model without sharing and one with it name the same weights alike.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace loom::models {

// The owner of each layer of a model of `n_layers` layers: owners[i] is the layer whose weights
// layer i uses (owners[i] <= i; an owner owns itself). Patterns:
//   "" or "none"  every layer its own weights
//   "all"         every layer layer 0's weights
//   "cycle:K"     K blocks used in turn: layer i uses layer i mod K's (1 <= K <= n_layers)
//   "repeat:K"    each block used K times in a row: layer i uses layer K * (i / K)'s
//   "L=O,..."     layer L uses layer O's weights (O < L; O not itself a user of another layer;
//                 each L once); the other layers keep their own
// Anything else is a loom::Error naming the pattern (or the entry) and what is valid.
std::vector<int64_t> parse_layer_sharing(const std::string& pattern, int64_t n_layers);

// The distinct owners among layers [first, end), ascending: the blocks a model part holds.
std::vector<int64_t> held_blocks(const std::vector<int64_t>& owners, int64_t first, int64_t end);

// Whether any layer outside [first, end) uses block `owner` (so another pipeline stage holds a
// copy of it too).
bool used_outside(const std::vector<int64_t>& owners, int64_t owner, int64_t first, int64_t end);

// Parameters named "<prefix>.<layer>.<rest>" (as a model with sharing stores them: one copy per
// owner) expanded to one copy per layer, as a model without sharing names them: layer i gets a
// copy of its owner's tensors. Other names pass through. Throws loom::Error when an owner's
// tensors are missing.
std::map<std::string, at::Tensor> expand_shared_layers(std::map<std::string, at::Tensor> tensors,
                                                       const std::string& prefix,
                                                       const std::vector<int64_t>& owners);

}  // namespace loom::models
