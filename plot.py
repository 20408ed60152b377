"""Plots of training runs, overlaid: loss against step and against tokens, validation loss (all sources, and each
source of a mixture), and the answer accuracy of SFT and GRPO runs, with GRPO's reward, share of replies in the worked
mode and reply length, each panel drawn only when some run logged its metric.

    python plot.py runs/ddp_pretrain runs/fsdp1_pretrain runs/fsdp2_pretrain --out pretrain.png
    python plot.py runs/fsdp2_sft runs/fsdp2_grpo --out stages.png

RUN_DIR is a script's --out-dir (its metrics.jsonl), and --out may stand anywhere among them. Each run is labelled by
its folder's name (and its parents', where two runs share a name) and drawn in one colour in every panel.
"""
import json
import sys
from pathlib import Path

import numpy as np

import common

# (metric, x axis, title) of each panel, in order; a panel is drawn when some run logged the metric.
PANELS = [("loss", "step", "training loss"), ("loss", "tokens", "training loss"),
          ("val_loss", "step", "validation loss"), ("val_accuracy", "step", "held-out answer accuracy"),
          ("reward", "step", "mean reward"), ("worked", "step", "replies in the worked mode"),
          ("reply_tokens", "step", "reply length (tokens)")]


def read_metrics(run_dir, what_to_do):
    """The rows of RUN_DIR/metrics.jsonl (none readable: one line ending in WHAT_TO_DO). A line that is no whole row (a
    last line cut short as its run was killed, or a damaged file) is skipped, and said once on stderr."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise common.UsageError(f"{run_dir}: no readable metrics.jsonl ({common.error_reason(error)}): "
                                f"{what_to_do}") from None
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    rows = [row for row in rows if isinstance(row, dict)]
    if len(rows) < len(lines):
        print(f"note: {path}: skipped {len(lines) - len(rows)} line(s) that hold no whole row (a run stopped while "
              f"writing one)", file=sys.stderr)
    return rows


def read_run(run_dir):
    """{(metric, x): ([x], [y])} of a run, x being "step", or "tokens": the tokens trained on up to that step (the
    running total of the logged steps' tokens; with --log-every N, N times that, an estimate)."""
    rows = read_metrics(run_dir, "pass a script's --out-dir")
    config = Path(run_dir) / "config.json"
    log_every = json.loads(config.read_text())["flags"].get("log_every", 1) if config.is_file() else 1
    series, tokens = {}, 0
    for row in rows:
        tokens += row.get("tokens", 0) * log_every
        for metric, value in row.items():
            if metric not in ("step", "tokens") and isinstance(value, (int, float)):
                series.setdefault((metric, "step"), ([], []))
                series[metric, "step"][0].append(row["step"])
                series[metric, "step"][1].append(value)
                series.setdefault((metric, "tokens"), ([], []))
                series[metric, "tokens"][0].append(tokens)
                series[metric, "tokens"][1].append(value)
    return series


def run_labels(run_dirs):
    """Each run's label: its folder's name, with as many parent folders as it takes to tell it from the others
    (seed0/sft and seed1/sft)."""
    paths = [Path(run_dir).resolve().parts for run_dir in run_dirs]
    for depth in range(1, max(map(len, paths)) + 1):
        labels = ["/".join(parts[-depth:]) for parts in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(run_dir) for run_dir in run_dirs]  # the same folder twice: its path twice


def plot(run_dirs, out):
    """Draw the runs' panels side by side into the image file `out`; returns the panels' names."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    runs = dict(zip(run_labels(run_dirs), map(read_run, run_dirs)))
    per_source = [{metric for metric, _ in series if metric.startswith("val_loss/")} for series in runs.values()]
    # A panel per source of the mixtures among the runs (a single source's loss is the validation loss itself).
    sources = sorted(set().union(*[metrics for metrics in per_source if len(metrics) > 1]))
    panels = [*PANELS[:3], *[(metric, "step", f"validation loss: {metric[9:]}") for metric in sources], *PANELS[3:]]
    panels = [panel for panel in panels if any(panel[:2] in series for series in runs.values())]
    if not panels:
        raise common.UsageError(f"none of {', '.join(map(str, run_dirs))} logged a metric to plot: pass runs that "
                                f"trained at least one step")
    figure = draw(runs, panels)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return [f"{title} against {x}" for _, x, title in panels]


def draw(runs, panels):
    """A figure of one panel per (metric, x, title), each run in its own colour and line style in every panel, and one
    legend for them all, below the panels."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4 + 0.25 * len(runs)), squeeze=False)
    # Dashes and dots keep equal curves visible on top of each other.
    styles = {name: (f"C{i % 10}", ["-", "--", ":", "-."][i % 4]) for i, name in enumerate(runs)}
    for axis, (metric, x, title) in zip(axes[0], panels):
        for name, series in runs.items():
            if (metric, x) in series:
                axis.plot(*series[metric, x], styles[name][1], color=styles[name][0], label=name, linewidth=1.4)
        axis.set(title=title, xlabel=x, ylabel=metric)
        axis.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))  # token counts as 1e6, not 1000000
        axis.grid(alpha=0.3)
    handles = [Line2D([], [], color=color, linestyle=line, linewidth=1.4) for color, line in styles.values()]
    figure.legend(handles, list(styles), loc="lower center", ncol=min(len(runs), 4), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06 + 0.05 * ((len(runs) - 1) // 4), 1, 1))  # room for the legend below the panels
    return figure


# (task, metric, title) of the abilities figure: evaluate.py's scores of every checkpoint of pipeline.py's stages.
ABILITIES = [("prose_bpb", "bpb", "prose: bits per byte (lower is better)"),
             ("arith_choice", "accuracy", "arithmetic by choice: accuracy"),
             ("arith_gen", "accuracy", "arithmetic by generation: accuracy")]
STAGE_COLOURS = {"pretrain": "C0", "mid": "C1", "sft": "C2", "grpo": "C3", "control": "C7"}


def plot_abilities(rows, out):
    """Each ability against the training tokens seen over all stages so far: a point per checkpoint with its 95%
    interval, a colour per stage, a dotted line where each stage starts. rows: evaluate.py's, each with its stage and
    tokens and where its stage started (pipeline.py's eval.jsonl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(row["stage"] for row in rows))
    figure, axes = plt.subplots(1, len(ABILITIES), figsize=(5.2 * len(ABILITIES), 3.8), squeeze=False)
    for axis, (task, metric, title) in zip(axes[0], ABILITIES):
        for stage in stages:
            points = sorted((row["tokens"], row["value"], row["ci_low"], row["ci_high"]) for row in rows
                            if (row["stage"], row["task"], row["metric"]) == (stage, task, metric))
            if points:
                x, y, low, high = map(np.array, zip(*points))
                axis.errorbar(x, y, yerr=[y - low, high - y], fmt="o-", color=STAGE_COLOURS.get(stage, "C9"),
                              label=stage, capsize=3, markersize=4, linewidth=1.2)
        for stage in stages[1:]:  # where a stage starts: the tokens the stages before it had seen
            start = next(row["stage_start"] for row in rows if row["stage"] == stage)
            axis.axvline(start, color=STAGE_COLOURS.get(stage, "C9"), linestyle=":", linewidth=1)
        axis.set(title=title, xlabel="training tokens, all stages", ylabel=metric)
        axis.ticklabel_format(axis="x", style="sci", scilimits=(-3, 4))
        axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(stages), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main():
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("run_dirs", nargs="*", metavar="RUN_DIR", help="runs to overlay (their --out-dir)")
    parser.add_argument("--out", required=True, help="the image file to write (.png, .svg or .pdf)")
    parser.add_argument("--abilities", default=None, help="instead of runs: pipeline.py's eval.jsonl, drawn as each "
                        "ability against the training tokens of all stages")
    args = parser.parse_intermixed_args()  # --out may stand anywhere among the runs
    if args.abilities:
        plot_abilities([json.loads(line) for line in Path(args.abilities).read_text().splitlines()], args.out)
        print(f"wrote {args.out}: {'; '.join(title for _, _, title in ABILITIES)} against the training tokens")
        return
    if not args.run_dirs:
        parser.error("pass the runs to plot (their --out-dir), or --abilities eval.jsonl")
    panels = plot(args.run_dirs, args.out)
    print(f"wrote {args.out}: {'; '.join(panels)}")


if __name__ == "__main__":
    main()
