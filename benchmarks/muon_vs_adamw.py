"""Muon against AdamW on the CPU: fsdp2_muon_pretrain.py and fsdp2_pretrain.py, the same model, data and batches. Each
optimizer's learning rate is chosen on a seed that is not reported (--choose-seed), from a grid widened a half-decade at
a time until its best rate has a worse one on each side; each then runs at its best rate with the reported seeds. How
many steps does Muon need to reach AdamW's final validation loss?

    python benchmarks/muon_vs_adamw.py --out runs/muon_vs_adamw        # small preset, 2 ranks, 300 steps a run

Writes results.json and curves.png (validation loss against step, every reported run) into --out; prints a table. A
finished run is read, not run again, while its command, the repository's Python files, the data and the versions are
the same; a failed run prints its stderr's end and stops the benchmark.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from runs import finite, run_once

SCRIPTS = {"AdamW": "fsdp2_pretrain.py", "Muon": "fsdp2_muon_pretrain.py"}
LADDER = ["1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1", "3e-1"]  # the rates a grid may widen to
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/muon_vs_adamw")
parser.add_argument("--model", default="small")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--eval-every", type=int, default=10)
parser.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2", help="AdamW's first grid, from LADDER")
parser.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2", help="Muon's first grid, from LADDER")
parser.add_argument("--choose-seed", type=int, default=3, help="the seed the rates are chosen on, not reported")
parser.add_argument("--seeds", default="0,1,2", help="the seeds reported, at each optimizer's best rate")
cli = parser.parse_args()
out = Path(cli.out)


def run(optimizer, lr, seed):
    """A run's validation losses {step: loss} and its seconds per step, evaluations included (from its metrics)."""
    folder = out / f"{optimizer}-lr{lr}-seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPTS[optimizer],
               "--model", cli.model, "--lr", lr, "--seed", str(seed), "--max-steps", str(cli.steps), "--eval-every",
               str(cli.eval_every), "--save-every", str(cli.steps), "--out-dir", str(folder)]
    run_once(folder, command, ["data/builtin"])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    val = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    steps = [row for row in rows if "loss" in row]
    return val, steps[-1]["elapsed_s"] / len(steps)


def steps_to_reach(val, target):
    """The first step (interpolated between evaluations) at which the validation loss is at most target."""
    points = sorted(val.items())
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if v1 <= target:
            return s1 if v0 == v1 else s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
    return None


def bracketed_best(optimizer, grid):
    """The grid's best rate on --choose-seed, the grid widened along LADDER while the best is at one of its ends."""
    grid = sorted(grid, key=LADDER.index)
    while True:
        best = min(grid, key=lambda lr: finite(run(optimizer, lr, cli.choose_seed)[0][cli.steps]))
        end = LADDER.index(best) + (1 if best == grid[-1] else -1 if best == grid[0] else 0)
        if best not in (grid[0], grid[-1]) or not 0 <= end < len(LADDER):
            return best, grid
        grid = sorted(set(grid) | {LADDER[end]}, key=LADDER.index)


seeds = [int(seed) for seed in cli.seeds.split(",")]
if cli.choose_seed in seeds:
    parser.error(f"--choose-seed {cli.choose_seed} is among --seeds: the rate would be chosen on a reported seed")
chosen = {"AdamW": bracketed_best("AdamW", cli.adamw_lrs.split(",")),
          "Muon": bracketed_best("Muon", cli.muon_lrs.split(","))}
best = {optimizer: lr for optimizer, (lr, _) in chosen.items()}
sweep = {(optimizer, lr): run(optimizer, lr, cli.choose_seed) for optimizer, (_, grid) in chosen.items()
         for lr in grid}
runs = {(optimizer, seed): run(optimizer, best[optimizer], seed) for seed in seeds for optimizer in SCRIPTS}  # by pairs
ratios = []
for seed in seeds:
    target = runs["AdamW", seed][0][cli.steps]
    reached = steps_to_reach(runs["Muon", seed][0], target)
    ratios.append(reached / cli.steps if reached is not None else None)
found = [ratio for ratio in ratios if ratio is not None]
mean = statistics.mean(found) if found else None
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, two-sided 95%, by degrees of freedom
half = T_975[len(found) - 1] * statistics.stdev(found) / len(found) ** 0.5 if 1 < len(found) <= 5 else None
results = {"steps": cli.steps, "model": cli.model, "choose_seed": cli.choose_seed, "seeds": seeds, "best": best,
           "sweep": {f"{o} {lr}": {"final_val_loss": v[cli.steps], "s_per_step": t}
                     for (o, lr), (v, t) in sweep.items()},
           "runs": {f"{o} seed {s}": {"val": v, "s_per_step": t} for (o, s), (v, t) in runs.items()},
           "muon_steps_over_adamw_steps": ratios, "mean": mean, "interval_95": half}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(f"{'optimizer':>9} {'lr':>6} final val loss (seed {cli.choose_seed}), s a step (evaluations included)")
for (optimizer, lr), (val, seconds) in sweep.items():
    print(f"{optimizer:>9} {lr:>6} {val[cli.steps]:.4f} {seconds:.2f}{'  best' if best[optimizer] == lr else ''}")
for seed, ratio in zip(seeds, ratios):
    print(f"seed {seed}: AdamW {runs['AdamW', seed][0][cli.steps]:.4f} at step {cli.steps}; Muon reaches it at "
          + (f"step {ratio * cli.steps:.0f} ({ratio:.2f} of AdamW's)" if ratio is not None else "no step"))
if mean is not None:
    print(f"Muon's steps over AdamW's: {mean:.2f}" + (f" +- {half:.2f} (95%, t over {len(found)} seeds)" if half
                                                        else ""))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

figure, axes = plt.subplots(figsize=(8, 5))
for (optimizer, seed), (val, _) in runs.items():
    axes.plot(list(val), list(val.values()), color="C0" if optimizer == "AdamW" else "C1", alpha=0.8,
              label=f"{optimizer}, lr {best[optimizer]}" if seed == seeds[0] else None)
late = [loss for val, _ in runs.values() for step, loss in val.items() if step >= cli.steps // 10]
axes.set(xlabel="step", ylabel="validation loss", ylim=(min(late) - 0.1, max(late) + 0.1),
         title=f"{cli.model}, 2 ranks, seeds {cli.seeds}")
axes.legend()
figure.savefig(out / "curves.png", dpi=110, bbox_inches="tight")
print(f"results.json and curves.png in {out}")
