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
// --sequence-parallel. Every rank takes rank 0's choice. Refused (loom::Error) with --resume and
// with a custom model: the plan needs a model shape known before the run starts.
void plan_layout_if_asked(PretrainCommandLine& cli, dist::Runtime& runtime);

}  // namespace loom::apps
