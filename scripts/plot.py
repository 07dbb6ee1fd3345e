"""Training curves from loom-pretrain metrics files (--metrics-out): loss (train and
validation), tokens/s, gradient norm and memory against steps, one line per run.

Each run is labelled by the flags in which it differs from the others (the "run" entry the
trainer writes into its first record: the run's configuration), or by --label. Written with
matplotlib's Agg backend: no display needed. Usage: scripts/plot (the shell wrapper), see --help.
"""

import argparse
import json
import math
import os
import sys

FORMATS = (".png", ".pdf", ".svg")
# Flags that say where a run wrote things or resumed from, not what it trained.
NOT_LABELS = {"metrics_out", "save_dir", "resume", "export_hf", "log_every", "save_every"}


class InputError(Exception):
    pass


def read_run(path):
    """The records of one metrics file: the steps' dicts (in file order) and the run entry."""
    if not os.path.isfile(path):
        raise InputError(f"metrics file '{path}' does not exist")
    records, run = [], None
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{number}: not a JSON record ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise InputError(f"{path}:{number}: a record without an integer 'step'")
            if run is None and isinstance(record.get("run"), dict):
                run = record["run"]
            records.append(record)
    if not any("loss" in r for r in records):
        raise InputError(f"metrics file '{path}' holds no training-loss record "
                         "(a loom-pretrain --metrics-out file has one per step)")
    return records, run


def flag(key, value):
    if isinstance(value, (dict, list)):
        return f"--{key.replace('_', '-')} {json.dumps(value, separators=(',', ':'))}"
    if isinstance(value, bool):
        return f"--{key.replace('_', '-')}" if value else f"--no-{key.replace('_', '-')}"
    return f"--{key.replace('_', '-')} {value}"


def labels_of(paths, runs):
    """The flags that differ between the runs; a run's file name when that says nothing."""
    flags = [((run or {}).get("flags") or {}) for run in runs]
    keys = sorted({k for f in flags for k in f if k not in NOT_LABELS})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flags}) > 1]
    labels = []
    for path, f, run in zip(paths, flags, runs):
        parts = [flag(k, f[k]) for k in differing if k in f]
        if len(paths) == 1 and f:
            # One run: what it is (model, preset, layout).
            parts = [flag(k, f[k]) for k in ("model", "preset") if f.get(k)]
            if run and run.get("world_size"):
                parts.append(f"{run['world_size']} rank{'s' if run['world_size'] != 1 else ''}")
        labels.append(", ".join(parts) if parts else os.path.basename(path))
    return labels


def series(records, key, scale=1.0):
    points = [(r["step"], r[key] * scale) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in points], [p[1] for p in points]


def running_mean(values, window):
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def memory_series(records):
    points = [(r["step"], r["memory"]["peak_bytes"] / 2**20) for r in records
              if isinstance(r.get("memory"), dict)
              and isinstance(r["memory"].get("peak_bytes"), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def main(argv):
    parser = argparse.ArgumentParser(
        prog="scripts/plot",
        description="Draw loss (train and validation), tokens/s, gradient norm and peak memory "
                    "against steps for one or several loom-pretrain --metrics-out files.")
    parser.add_argument("metrics", nargs="+", help="metrics files (JSON lines)")
    parser.add_argument("--out", required=True,
                        help=f"the figure to write; its format by extension: {', '.join(FORMATS)}")
    parser.add_argument("--label", action="append", default=None,
                        help="a run's label, once per metrics file in order (default: the flags "
                             "in which the runs differ)")
    parser.add_argument("--title", default=None, help="a title above the panels")
    args = parser.parse_args(argv)

    try:
        extension = os.path.splitext(args.out)[1].lower()
        if extension not in FORMATS:
            raise InputError(f"--out '{args.out}': the extension '{extension}' is not one of "
                             f"{', '.join(FORMATS)}")
        if args.label is not None and len(args.label) != len(args.metrics):
            raise InputError(f"--label given {len(args.label)} times for {len(args.metrics)} "
                             "metrics files: give one per file, or none")
        read = [read_run(p) for p in args.metrics]
    except InputError as e:
        print(f"scripts/plot: {e}", file=sys.stderr)
        return 2

    try:
        import matplotlib
    except ImportError:
        print("scripts/plot: matplotlib is missing from .venv: run scripts/setup", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = args.label or labels_of(args.metrics, [run for _, run in read])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), layout="constrained")
    (loss_ax, speed_ax), (norm_ax, memory_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles, low, high = [], [], []
    for i, ((records, _), label) in enumerate(zip(read, labels)):
        color = colors[i % len(colors)]
        steps, loss = series(records, "loss")
        # Single-step losses are noisy: the raw curve faint, its running mean over ~2% of the
        # steps on top.
        loss_ax.plot(steps, loss, color=color, linewidth=0.6, alpha=0.3)
        (line,) = loss_ax.plot(steps, running_mean(loss, max(1, len(loss) // 50)), color=color,
                               linewidth=1.4)
        handles.append((line, label))
        tail = loss[len(loss) // 20:] or loss
        low.append(min(tail))
        high.append(max(tail))
        val_steps, val = series(records, "val_loss")
        if val_steps:
            loss_ax.plot(val_steps, val, color=color, linestyle="--", marker="o", markersize=4)
            low.append(min(val))
        speed_ax.plot(*series(records, "tokens_per_s"), color=color, linewidth=0.8)
        norm_ax.plot(*series(records, "grad_norm"), color=color, linewidth=0.8)
        memory_ax.plot(*memory_series(records), color=color, linewidth=1.2)
    # The first steps' losses (the initial ~ln(vocab)) would flatten everything after them.
    span = max(high) - min(low)
    loss_ax.set_ylim(min(low) - 0.05 * span, max(high) + 0.05 * span)
    for ax, title, unit in ((loss_ax, "loss (solid: training, running mean; dashed: validation)",
                             "nats per token"),
                            (speed_ax, "throughput", "tokens/s"),
                            (norm_ax, "gradient norm (before clipping)", "norm"),
                            (memory_ax, "peak memory (this rank)", "MiB")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
    norm_ax.set_yscale("log")
    fig.legend([h for h, _ in handles], [l for _, l in handles], loc="outside lower center",
               fontsize=9, frameon=False)
    if args.title:
        fig.suptitle(args.title)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=100)
    for path, (records, _), label in zip(args.metrics, read, labels):
        steps = [r["step"] for r in records if "loss" in r]
        print(f"{path}: '{label}', steps {steps[0]}-{steps[-1]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
