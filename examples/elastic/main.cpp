// loom-elastic: runs a training command under mpirun and, when a rank is lost, runs it again on
// the survivors from the last complete checkpoint (loom/apps/elastic.h, docs/reliability.md).
#include "loom/apps/elastic.h"

int main(int argc, char** argv) {
  return loom::apps::elastic_main(argc, argv);
}
