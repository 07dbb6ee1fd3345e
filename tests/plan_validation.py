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
  TOOLS=... MPIEXEC=... python3 tests/plan_validation.py --sweep --world 1 2 4     # planner's best
  TOOLS=... MPIEXEC=... python3 tests/plan_validation.py --shapes --world 1 2 3 4 5 6 7 8 \
      --results shapes.json                    # every parallel shape: docs/plan-validation.md

--shapes runs, for each world size and preset, the planner's best layout of every (dp, tp, pp,
cp) it lists, one profile per (world, preset) so that the shapes are ranked on one profile, and
reports how well the prediction orders them: the rank correlation, and how far the measured
throughput of the planner's first choice is from the fastest measured shape.
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


def plan_command(args, preset, world, profile):
    family = preset.split("-")[0]
    return [f"{args.tools}/loom-plan", "--model", family, "--preset", preset,
            "--world", str(world), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--precision", "fp32", "--vocab-size", "256",
            "--profile", profile, "--json", "--top", "100000"]


def plans(args, preset, world, profile):
    return json.loads(run(plan_command(args, preset, world, profile), "loom-plan"))


def shape_of(layout):
    return tuple(layout[k] for k in ("dp", "tp", "pp", "cp"))


def best_of_each_shape(args, preset, world, profile):
    """The planner's first layout of each (dp, tp, pp, cp), best first; None and the planner's
    reason where no layout of `world` ranks can run the preset (it prints why and exits 2)."""
    out = subprocess.run(plan_command(args, preset, world, profile), capture_output=True,
                         text=True)
    if out.returncode == 2 and "no layout" in out.stderr:
        return None, out.stderr.strip().splitlines()[-1]
    if out.returncode != 0:
        sys.exit(f"loom-plan failed (status {out.returncode}):\n{out.stderr[-3000:]}")
    seen, best = set(), []
    for q in json.loads(out.stdout):
        if shape_of(q) not in seen:
            seen.add(shape_of(q))
            best.append(q)
    return best, None


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


def rank_correlation(xs, ys):
    """Spearman's rho (ties get their mean rank); None for fewer than 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def shapes_main(args, work):
    """Every parallel shape at every --world: see the module's docstring."""
    print(f"| Layout ({args.batch_size} x {args.seq_len} tokens, fp32) | ranks | tokens/s "
          "predicted | best step | error | median step | peak memory predicted | measured "
          "| error |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, groups, failures = [], [], []
    for world in args.world:
        for preset in args.presets:
            profile = measure(args, world, work)
            listed, why_none = best_of_each_shape(args, preset, world, profile)
            if listed is None:
                groups.append({"preset": preset, "world": world, "shapes": 0, "none": why_none})
                print(f"| {preset}: no layout of {world} ranks ({why_none}) | {world} "
                      "| | | | | | | |", flush=True)
                continue
            group = []
            for plan in listed:
                layout = {k: plan[k] for k in DEFAULTS}
                try:
                    best, median, peak = measure_run(args, preset, layout, world, work)
                except SystemExit as failed:  # a listed layout that does not train: a finding
                    failures.append(f"{describe(preset, layout)} at {world}: {failed}")
                    print(f"| {describe(preset, layout)} | {world} | FAILED | | | | | | |",
                          flush=True)
                    continue
                row = {"preset": preset, "world": world, "layout": layout,
                       "describe": describe(preset, layout),
                       "predicted_tokens_per_s": plan["tokens_per_s"],
                       "best_tokens_per_s": best, "median_tokens_per_s": median,
                       "predicted_peak_bytes": plan["rank_memory_bytes"][0], "peak_bytes": peak}
                row["time_error"] = row["predicted_tokens_per_s"] / best - 1
                row["memory_error"] = row["predicted_peak_bytes"] / peak - 1
                rows.append(row)
                group.append(row)
                print(f"| {row['describe']} | {world} | {row['predicted_tokens_per_s']:.0f} | "
                      f"{best:.0f} | {100 * row['time_error']:+.1f} % | {median:.0f} | "
                      f"{row['predicted_peak_bytes'] / 2**20:.1f} MiB | {peak / 2**20:.1f} MiB | "
                      f"{100 * row['memory_error']:+.1f} % |", flush=True)
            if not group:
                groups.append({"preset": preset, "world": world, "shapes": 0,
                               "none": f"all {len(listed)} shapes failed to train"})
                continue
            fastest = max(group, key=lambda r: r["best_tokens_per_s"])
            # Listed best first: the planner's choice is listed[0], measured only if it trained.
            choice = describe(preset, {k: listed[0][k] for k in DEFAULTS})
            chosen = [r for r in group if r["describe"] == choice]
            groups.append({
                "preset": preset, "world": world, "shapes": len(group),
                "rank_correlation": rank_correlation(
                    [r["predicted_tokens_per_s"] for r in group],
                    [r["best_tokens_per_s"] for r in group]),
                "choice": choice, "fastest": fastest["describe"],
                "choice_vs_fastest": (chosen[0]["best_tokens_per_s"] / fastest["best_tokens_per_s"]
                                      if chosen else None),
            })

    print("\n| model | ranks | shapes | rank correlation | planner's choice | its measured "
          "tokens/s against the fastest shape's | fastest shape measured |")
    print("|---|---|---|---|---|---|---|")
    for g in groups:
        if not g["shapes"]:
            print(f"| {g['preset']} | {g['world']} | 0 | | {g['none']} | | |")
            continue
        rho, ratio = g["rank_correlation"], g["choice_vs_fastest"]
        print(f"| {g['preset']} | {g['world']} | {g['shapes']} | "
              f"{'' if rho is None else f'{rho:+.2f}'} | {g['choice']} | "
              f"{'failed' if ratio is None else f'{100 * ratio:.0f} %'} | {g['fastest']} |")
    if rows:
        te = [abs(r["time_error"]) for r in rows]
        me = [abs(r["memory_error"]) for r in rows]
        print(f"\n{len(rows)} runs: median |tokens/s error| {100 * statistics.median(te):.1f} % "
              f"(90th percentile {100 * sorted(te)[int(0.9 * (len(te) - 1))]:.1f} %, largest "
              f"{100 * max(te):.1f} %); |peak memory error| median "
              f"{100 * statistics.median(me):.1f} %, largest {100 * max(me):.1f} %")
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"rows": rows, "groups": groups, "failures": failures}, f, indent=1)
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def parse_args():
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
    p.add_argument("--presets", nargs="+",
                   default=["gpt2-tiny", "llama-tiny", "gpt2-mini", "llama-mini"])
    p.add_argument("--top", type=int, default=8, help="with --sweep: the planner's best N each")
    p.add_argument("--shapes", action="store_true",
                   help="the planner's best layout of every (dp, tp, pp, cp) at each --world")
    p.add_argument("--results", help="with --shapes: every row and summary as JSON")
    p.add_argument("--data", help="a prepared data directory (default: a generated corpus)")
    p.add_argument("--no-retry", action="store_true",
                   help="fail on the first measurement outside the bounds")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after the {args.warmup} of --warmup")
    return args


def main(args):
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
        if args.shapes:
            return shapes_main(args, work)
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
    args = parse_args()
    # Memory is deterministic; time is measured on a machine that others may share. A time
    # error past the bound is measured once more, all cases again, and fails only if it
    # repeats: a model that is off fails both times, a noisy minute does not.
    status = main(args)
    if status != 0 and not (args.no_retry or args.sweep or args.shapes):
        print("\nOutside the bounds: measuring every case once more.", flush=True)
        status = main(args)
    return status


if __name__ == "__main__":
    sys.exit(main_with_retry())
