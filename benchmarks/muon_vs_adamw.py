"""Muon against AdamW on the CPU: fsdp2_muon_pretrain.py and fsdp2_pretrain.py, the same model, data and batches, each
at three learning rates (seed 0), then each at its best rate with two more seeds. How many steps does Muon need to
reach AdamW's final validation loss?

    python benchmarks/muon_vs_adamw.py --out runs/muon_vs_adamw        # small preset, 2 ranks, 300 steps a run

Writes results.json and curves.png (validation loss against step, every run) into --out; prints a table. A finished run
is read, not run again, while its command and the repository's Python files are the same.
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"AdamW": "fsdp2_pretrain.py", "Muon": "fsdp2_muon_pretrain.py"}
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/muon_vs_adamw")
parser.add_argument("--model", default="small")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--eval-every", type=int, default=10)
parser.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the learning rates tried at seed 0")
parser.add_argument("--seeds", default="0,1,2")
cli = parser.parse_args()
out = Path(cli.out)


def run(optimizer, lr, seed):
    """A run's validation losses {step: loss} and its seconds per step, evaluations included (from its metrics)."""
    folder = out / f"{optimizer}-lr{lr}-seed{seed}"
    metrics = folder / "metrics.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPTS[optimizer],
               "--model", cli.model, "--lr", lr, "--seed", str(seed), "--max-steps", str(cli.steps), "--eval-every",
               str(cli.eval_every), "--save-every", str(cli.steps), "--out-dir", str(folder)]
    key = {"command": command, "code": {path.name: hashlib.sha256(path.read_bytes()).hexdigest()
                                        for path in sorted(REPO.glob("*.py"))}}  # every script and shared module
    if not (folder / "run-key.json").is_file() or json.loads((folder / "run-key.json").read_text()) != key:
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        (folder / "run-key.json").write_text(json.dumps(key))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
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


lrs, seeds = cli.lrs.split(","), [int(seed) for seed in cli.seeds.split(",")]
sweep = {(optimizer, lr): run(optimizer, lr, seeds[0]) for optimizer in SCRIPTS for lr in lrs}
best = {optimizer: min(lrs, key=lambda lr: sweep[optimizer, lr][0][cli.steps]) for optimizer in SCRIPTS}
runs = {(optimizer, seed): sweep[optimizer, best[optimizer]] if seed == seeds[0] else run(optimizer, best[optimizer],
                                                                                          seed)
        for optimizer in SCRIPTS for seed in seeds}
ratios = []
for seed in seeds:
    target = runs["AdamW", seed][0][cli.steps]
    reached = steps_to_reach(runs["Muon", seed][0], target)
    ratios.append(reached / cli.steps if reached is not None else None)
found = [ratio for ratio in ratios if ratio is not None]
mean = statistics.mean(found) if found else None
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, two-sided 95%, by degrees of freedom
half = T_975[len(found) - 1] * statistics.stdev(found) / len(found) ** 0.5 if 1 < len(found) <= 5 else None
results = {"steps": cli.steps, "model": cli.model, "lrs": lrs, "seeds": seeds, "best": best,
           "sweep": {f"{o} {lr}": {"final_val_loss": v[cli.steps], "s_per_step": t}
                     for (o, lr), (v, t) in sweep.items()},
           "runs": {f"{o} seed {s}": {"val": v, "s_per_step": t} for (o, s), (v, t) in runs.items()},
           "muon_steps_over_adamw_steps": ratios, "mean": mean, "interval_95": half}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(f"{'optimizer':>9} {'lr':>6} final val loss (seed {seeds[0]}), s a step (evaluations included)")
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
