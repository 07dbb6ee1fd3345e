// loom-pretrain: pretrain a GPT-2 or Llama model on token files, in one process or as many
// ranks as `mpirun -np N` starts. The command line itself is a library function
// (loom/apps/pretrain.h), so a binary of your own can register strategies and run the same CLI.
#include "loom/apps/pretrain.h"

int main(int argc, char** argv) {
  return loom::apps::pretrain_main(argc, argv);
}
