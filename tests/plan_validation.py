#!/usr/bin/env python3
"""The cost model against measured training runs (docs/planner.md, "Validation").

Measures this machine with `loom-plan --measure` at the runs' rank count, then for each layout
runs loom-pretrain under mpirun and compares:
  - tokens/s: the best step after the warm-up, against loom-plan's prediction (the profile's
    reference is its fastest sample too: both are what the machine does when nothing else
    interferes; the median step is printed beside it);
  - peak memory: rank 0's peak (the metrics file), against the prediction for pipeline rank 0.

Fails (exit 1) when the median tokens/s error exceeds --max-time-error or any run's memory error
exceeds --max-memory-error, or when a run or a prediction fails. Prints the table either way.

  TOOLS=build/examples MPIEXEC=mpirun python3 tests/plan_validation.py            # the fixed set
  TOOLS=... MPIEXEC=... python3 tests/plan_validation.py --sweep --world 1 2 4     # docs' table
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The fixed set the test holds: 2 ranks, one layout per kind of parallelism the model counts.
FIXED = [
    ("gpt2-tiny", {"dp": 2}),
    ("gpt2-tiny", {"tp": 2, "sequence_parallel": True}),
    ("gpt2-tiny", {"pp": 2, "micro_batches": 4, "schedule": "1f1b"}),
    ("gpt2-tiny", {"dp": 2, "checkpointing": "full"}),
    ("llama-tiny", {"dp": 2, "zero": 1}),
    ("llama-tiny", {"pp": 2, "micro_batches": 2, "schedule": "gpipe"}),
]
DEFAULTS = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "zero": 0, "micro_batches": 1,
            "virtual_stages": 1, "schedule": "none", "checkpointing": "none",
            "sequence_parallel": False}


def run(cmd, what):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{what} failed (status {out.returncode}): {' '.join(cmd)}\n"
                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def mpi(args, world):
    return [args.mpiexec, "-np", str(world)]


# One thread per rank; Open MPI's settings for more ranks than cores and for root (as ctest's
# LOOM_MPI_ENV sets them) where the caller has not.
for key, value in {"OMP_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                   "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                   "OMPI_MCA_rmaps_base_oversubscribe": "1"}.items():
    os.environ.setdefault(key, value)


def layout_of(overrides):
    layout = dict(DEFAULTS)
    layout.update(overrides)
    return layout


def describe(preset, layout):
    parts = [f"{k} {layout[k]}" for k in ("dp", "tp", "pp", "cp") if layout[k] > 1]
    if layout["sequence_parallel"]:
        parts.append("sp")
    if layout["zero"]:
        parts.append(f"zero {layout['zero']}")
    if layout["pp"] > 1:
        parts.append(f"{layout['micro_batches']} mb {layout['schedule']}"
                     + (f" x{layout['virtual_stages']}" if layout["virtual_stages"] > 1 else ""))
    elif layout["micro_batches"] > 1:
        parts.append(f"{layout['micro_batches']} mb")
    if layout["checkpointing"] != "none":
        parts.append(f"recompute {layout['checkpointing']}")
    return f"{preset}: " + (", ".join(parts) or "1 rank")


def measure(args, world, work):
    profile = os.path.join(work, f"profile{world}.json")
    run(mpi(args, world) + [f"{args.tools}/loom-plan", "--measure", "--precision", "fp32",
                            "--out", profile], f"loom-plan --measure at {world} ranks")
    return profile


def plans(args, preset, world, profile):
    family = preset.split("-")[0]
    out = run([f"{args.tools}/loom-plan", "--model", family, "--preset", preset,
               "--world", str(world), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len), "--precision", "fp32", "--vocab-size", "256",
               "--profile", profile, "--json", "--top", "100000"], "loom-plan")
    return json.loads(out)


def matches(plan, layout):
    return all(plan[k] == v for k, v in layout.items())


def measure_run(args, preset, layout, world, work):
    family = preset.split("-")[0]
    metrics = os.path.join(work, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = mpi(args, world) + [
        f"{args.tools}/loom-pretrain", "--model", family, "--preset", preset,
        "--data", os.path.join(work, "data", "train.bin"), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", "3e-3",
        "--precision", "fp32", "--threads", "1", "--log-level", "warn",
        "--metrics-out", metrics, "--dp", str(layout["dp"]), "--tp", str(layout["tp"]),
        "--pp", str(layout["pp"]), "--cp", str(layout["cp"]), "--zero", str(layout["zero"]),
        "--micro-batches", str(layout["micro_batches"]),
        "--activation-checkpointing", layout["checkpointing"]]
    if layout["pp"] > 1:
        cmd += ["--schedule", layout["schedule"], "--virtual-stages",
                str(layout["virtual_stages"])]
    if layout["sequence_parallel"]:
        cmd.append("--sequence-parallel")
    run(cmd, f"loom-pretrain ({describe(preset, layout)})")
    rows = [json.loads(line) for line in open(metrics)]
    timed = [r["tokens_per_s"] for r in rows if r["step"] > args.warmup]
    peak = max(r["memory"]["peak_bytes"] for r in rows)
    return max(timed), statistics.median(timed), peak


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=os.environ.get("TOOLS", "build/examples"))
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpirun"))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the comparison")
    p.add_argument("--max-time-error", type=float, default=0.25)
    p.add_argument("--max-memory-error", type=float, default=0.10)
    p.add_argument("--sweep", action="store_true",
                   help="every layout the planner lists for --presets at each --world")
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--presets", nargs="+", default=["gpt2-tiny", "llama-tiny", "gpt2-mini"])
    p.add_argument("--top", type=int, default=8, help="with --sweep: the planner's best N each")
    p.add_argument("--data", help="a prepared data directory (default: a generated corpus)")
    p.add_argument("--no-retry", action="store_true",
                   help="fail on the first measurement outside the bounds")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as work:
        if args.data:
            os.symlink(os.path.abspath(args.data), os.path.join(work, "data"))
        else:
            words = ["the", "model", "of", "a", "step", "time", "and", "memory", "rank",
                     "layout", "pipeline", "tensor", "data", "parallel", "zero", "loss"]
            text = " ".join(words[(i * 7 + i // 5) % len(words)] for i in range(60000))
            with open(os.path.join(work, "corpus.txt"), "w") as f:
                f.write(text)
            run([f"{args.tools}/loom-prepare", "--input", os.path.join(work, "corpus.txt"),
                 "--out-dir", os.path.join(work, "data")], "loom-prepare")
        # Each case is predicted from a profile measured just before it runs: this machine's
        # speed drifts (a shared VM's by 20 % over minutes), and the model is judged, not the
        # drift between a measurement and a run minutes later.
        cases = []
        if args.sweep:
            for world in args.world:
                profile = measure(args, world, work)
                for preset in args.presets:
                    listed = plans(args, preset, world, profile)[: args.top]
                    cases += [(preset, {k: q[k] for k in DEFAULTS}, world) for q in listed]
        else:
            cases = [(preset, layout_of(overrides), 2) for preset, overrides in FIXED]

        print(f"| Layout ({args.batch_size} x {args.seq_len} tokens, fp32) | ranks | tokens/s "
              "predicted | best step | error | median step | peak memory predicted | measured "
              "| error |")
        print("|---|---|---|---|---|---|---|---|---|")
        time_errors, memory_errors = [], []
        for preset, layout, world in cases:
            profile = measure(args, world, work)
            found = [q for q in plans(args, preset, world, profile) if matches(q, layout)]
            if not found:
                sys.exit(f"the planner has no prediction for {describe(preset, layout)}")
            plan = found[0]
            tokens_per_s, median_tokens_per_s, peak = measure_run(args, preset, layout, world, work)
            predicted_peak = plan["rank_memory_bytes"][0]
            te = plan["tokens_per_s"] / tokens_per_s - 1
            me = predicted_peak / peak - 1
            time_errors.append(te)
            memory_errors.append(me)
            print(f"| {describe(preset, layout)} | {world} | {plan['tokens_per_s']:.0f} | "
                  f"{tokens_per_s:.0f} | {100 * te:+.1f} % | {median_tokens_per_s:.0f} | "
                  f"{predicted_peak / 2**20:.1f} MiB | "
                  f"{peak / 2**20:.1f} MiB | {100 * me:+.1f} % |", flush=True)

    median_time = statistics.median(abs(e) for e in time_errors)
    worst_memory = max(abs(e) for e in memory_errors)
    print(f"\n{len(cases)} runs: median |tokens/s error| {100 * median_time:.1f} % "
          f"(bound {100 * args.max_time_error:.0f} %), largest |memory error| "
          f"{100 * worst_memory:.1f} % (bound {100 * args.max_memory_error:.0f} %), "
          f"median memory error {100 * statistics.median(abs(e) for e in memory_errors):.1f} %")
    ok = median_time <= args.max_time_error and worst_memory <= args.max_memory_error
    print("PASS" if ok else "FAIL: outside the bounds")
    return 0 if ok else 1


def main_with_retry():
    # Memory is deterministic; time is measured on a machine that others may share. A time
    # error past the bound is measured once more, all cases again, and fails only if it
    # repeats: a model that is off fails both times, a noisy minute does not.
    status = main()
    if status != 0 and "--no-retry" not in sys.argv and "--sweep" not in sys.argv:
        print("\nOutside the bounds: measuring every case once more.", flush=True)
        status = main()
    return status


if __name__ == "__main__":
    sys.exit(main_with_retry())
