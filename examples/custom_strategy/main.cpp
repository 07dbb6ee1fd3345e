// loom-pretrain plus the strategies of this project: `custom-pretrain --strategy
// local-sgd:every=4 ...` takes every flag loom-pretrain takes.
#include <loom/apps/pretrain.h>
#include <loom/train/strategy.h>

// local_sgd.cpp sits in a static library that nothing else references: this keeps its object
// file, and so its registration, in the binary.
LOOM_LINK_STRATEGY(local_sgd);

int main(int argc, char** argv) {
  return loom::apps::pretrain_main(argc, argv);
}
