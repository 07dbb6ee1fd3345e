#pragma once
// loom-pretrain's whole command line as a library function: a user's own binary registers its
// strategies (train/strategy.h) and then runs the same CLI, so `--strategy NAME[:key=value,...]`
// reaches them with every other flag of loom-pretrain (docs/strategies.md):
//
//   int main(int argc, char** argv) {
//     loom::train::register_strategy("my-strategy", ...);
//     return loom::apps::pretrain_main(argc, argv);
//   }
namespace loom::apps {

// Parses loom-pretrain's flags (or --config TOML), starts the ranks' runtime and trains.
// Returns the process exit code: 0, 1 (failure) or 2 (bad input, the message names it).
int pretrain_main(int argc, char** argv);

}  // namespace loom::apps
