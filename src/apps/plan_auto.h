#pragma once
// loom-pretrain --plan auto: the planner's best layout for this run's model, batch and world,
// among those agreeing with the layout flags the user gave, written into the flags before the
// mesh is built (docs/planner.md).
#include "loom/dist/runtime.h"
#include "pretrain_cli.h"

namespace loom::apps {

// Does nothing unless --plan is auto. Otherwise measures this machine with every rank (or reads
// --plan-profile), plans, logs the choice and why on rank 0, and sets --dp, --tp, --pp, --cp,
// --zero, --micro-batches, --schedule, --virtual-stages, --activation-checkpointing and
// --sequence-parallel (and, for a pipeline planned on a profile file or built-in profile,
// --pp-partition model with it), among the layouts the run's other flags go with. Every rank
// takes rank 0's choice; with --resume, for the checkpoint's model (which the Trainer then
// reshards to the layout chosen). Refused (loom::Error) with --pp-devices (the devices belong in
// the profile).
void plan_layout_if_asked(PretrainCommandLine& cli, dist::Runtime& runtime);

}  // namespace loom::apps
