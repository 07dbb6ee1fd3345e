#include "loom/parallel/tensor/tp_group.h"

#include "loom/core/error.h"

namespace loom::parallel::tensor {

TpGroup::TpGroup(dist::CommunicatorPtr comm, TpOptions options)
    : comm_(comm && comm->size() > 1 ? std::move(comm) : nullptr), options_(options) {
  LOOM_CHECK(options_.pad_vocab_multiple >= 1, "--pad-vocab-multiple {} must be >= 1",
             options_.pad_vocab_multiple);
}

int64_t TpGroup::padded_vocab(int64_t vocab) const {
  const int64_t multiple = options_.pad_vocab_multiple * size();
  return (vocab + multiple - 1) / multiple * multiple;
}

}  // namespace loom::parallel::tensor
