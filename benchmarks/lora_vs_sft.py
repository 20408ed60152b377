"""What LoRA gives up: fsdp2_sft.py against fsdp2_lora_sft.py on the CPU, from the same midtrained base (pipeline.py's
pretrain and mid stages), the same data (the SFT's, 10% pretraining text replayed) and the same steps. The full SFT,
LoRA r16 (its token rows trained: the markers) and LoRA r16 with the whole embedding trained (--train-embedding) each
have their learning rate chosen on a seed that is not reported (--choose-seed), from a grid widened a half-decade at a
time until its best rate has a worse one on each side; each then runs at that rate with the reported seeds, and so do
LoRA r8 and r64 at r16's rate (the best rate is nearly rank-free: one point checks it) and the best LoRA on a 4-bit base
(--base-dtype nf4). Every reported run is scored by evaluate.py on held-out problems, with 95% intervals.

    python benchmarks/lora_vs_sft.py --out runs/lora_vs_sft           # small preset, 2 ranks, 300 steps a run

Writes results.json and lora_vs_sft.png (validation loss against step, each reported run; accuracy with intervals)
into --out; prints a table. A finished run is read, not run again, while its command, the repository's Python files,
the data and the versions are the same; a failed run prints its stderr's end and stops the benchmark.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from runs import finite, run_once

LADDER = ["1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2", "1e-1", "3e-1"]  # the rates a grid may widen to
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]  # alpha = 2 r, as PEFT's examples
METHODS = {"full SFT": ("fsdp2_sft.py", []), "LoRA r16": ("fsdp2_lora_sft.py", LORA),
           "LoRA r16 + embedding": ("fsdp2_lora_sft.py", [*LORA, "--train-embedding"])}

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/lora_vs_sft")
parser.add_argument("--model", default="small")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--sft-lrs", default="1e-3,3e-3,1e-2", help="the full SFT's first grid, from LADDER")
parser.add_argument("--lora-lrs", default="3e-3,1e-2,3e-2", help="LoRA's first grids, from LADDER")
parser.add_argument("--choose-seed", type=int, default=3, help="the seed the rates are chosen on, not reported")
parser.add_argument("--seeds", default="0,1", help="the seeds reported, at each method's best rate")
parser.add_argument("--tasks", default="arith_gen,arith_reworded,solve")
parser.add_argument("--limit", type=int, default=200, help="evaluate.py's --limit: problems a task")
cli = parser.parse_args()
out = Path(cli.out)
out.mkdir(parents=True, exist_ok=True)
seeds = [int(seed) for seed in cli.seeds.split(",")]
if cli.choose_seed in seeds:
    parser.error(f"--choose-seed {cli.choose_seed} is among --seeds: the rate would be chosen on a reported seed")

base = out / "base"  # pipeline.py's pretraining and midtraining: the model every method finetunes
run_once(base, [sys.executable, "pipeline.py", "--stages", "pretrain,mid", "--model", cli.model, "--seed", "0",
                "--out-dir", str(base)], ["data/builtin", "data/builtin-sft"])


def run(method, lr, seed, extra=()):
    """A run's folder, its validation losses on the conversations {step: loss} (the replayed text's left out) and its
    seconds a step (evaluations included), from its metrics."""
    script, flags = METHODS.get(method, METHODS["LoRA r16"])
    folder = out / f"{method.replace(' ', '-')}-lr{lr}-seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, "--model",
               cli.model, "--init-from", str(base / "mid"), "--replay", "data/builtin:0.1", "--lr", lr, "--seed",
               str(seed), "--max-steps", str(cli.steps), "--eval-every", str(cli.steps // 6), "--save-every",
               str(cli.steps), "--eval-generate", "0", "--out-dir", str(folder), *flags, *extra]
    run_once(folder, command, ["data/builtin", "data/builtin-sft", base / "mid" / "checkpoints"])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    conversations = next(name for name in rows[-1] if name.startswith("val_loss/"))  # the first split: the SFT set's
    return folder, {row["step"]: row[conversations] for row in rows if conversations in row}, steps[-1][
        "elapsed_s"] / len(steps)


def bracketed_best(method, grid):
    """The grid's best rate on --choose-seed, the grid widened along LADDER while the best is at one of its ends."""
    grid = sorted(grid, key=LADDER.index)
    while True:
        best = min(grid, key=lambda lr: finite(run(method, lr, cli.choose_seed)[1][cli.steps]))  # a NaN never wins
        end = LADDER.index(best) + (1 if best == grid[-1] else -1 if best == grid[0] else 0)
        if best not in (grid[0], grid[-1]) or not 0 <= end < len(LADDER):
            return best, grid
        grid = sorted(set(grid) | {LADDER[end]}, key=LADDER.index)


chosen = {method: bracketed_best(method, (cli.sft_lrs if method == "full SFT" else cli.lora_lrs).split(","))
          for method in METHODS}
best = {method: lr for method, (lr, _) in chosen.items()}
sweep = {(method, lr): run(method, lr, cli.choose_seed) for method, (_, grid) in chosen.items() for lr in grid}
reported = {(method, seed): run(method, best[method], seed) for seed in seeds for method in METHODS}
lora_best = min(["LoRA r16", "LoRA r16 + embedding"], key=lambda m: statistics.mean(
    finite(reported[m, seed][1][cli.steps]) for seed in seeds))
nf4 = f"{lora_best}, nf4 base"
reported.update({(nf4, seed): run(nf4, best[lora_best], seed, [*METHODS[lora_best][1], "--base-dtype", "nf4"])
                 for seed in seeds})
for rank in ("8", "64"):  # at r16's rate, alpha 2 r, one seed
    reported[f"LoRA r{rank}", seeds[0]] = run(f"LoRA r{rank}", best["LoRA r16"], seeds[0],
                                              ["--lora-rank", rank, "--lora-alpha", str(2 * int(rank))])

scores = {}
for (method, seed), (folder, _, _) in reported.items():
    scored = folder / "eval" / "eval.jsonl"
    command = [sys.executable, "evaluate.py", str(folder), "--tasks", cli.tasks, "--limit", str(cli.limit), "--out",
               str(scored)]
    run_once(scored.parent, command, [folder / "checkpoints"])
    scores[method, seed] = {row["task"]: row for row in map(json.loads, scored.read_text().splitlines())
                            if row["metric"] == "accuracy"}

final = {key: val[cli.steps] for key, (_, val, _) in reported.items()}
methods = list(dict.fromkeys(method for method, _ in reported))
mean_final = {m: statistics.mean(final[m, s] for s in seeds if (m, s) in final) for m in methods}
results = {"model": cli.model, "steps": cli.steps, "choose_seed": cli.choose_seed, "seeds": seeds, "best_lr": best,
           "tasks": cli.tasks.split(","), "limit": cli.limit,
           "sweep": {f"{m} {lr}": {"final_val_loss": v[cli.steps], "s_per_step": t} for (m, lr), (_, v, t) in
                     sweep.items()},
           "reported": {f"{m} seed {s}": {"val": v, "s_per_step": t, "accuracy": scores[m, s]}
                        for (m, s), (_, v, t) in reported.items()},
           "mean_final_val_loss": mean_final,
           "best_lora_over_full_sft": mean_final[lora_best] / mean_final["full SFT"]}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(f"{'method':>22} {'lr':>6} final val loss (seed {cli.choose_seed}), s a step (evaluations included)")
for (method, lr), (_, val, seconds) in sweep.items():
    print(f"{method:>22} {lr:>6} {val[cli.steps]:.4f} {seconds:.2f}{'  best' if best[method] == lr else ''}")
print("| method (lr) | seed | final val loss | " + " | ".join(results["tasks"]) + " |")
for (method, seed), tasks in scores.items():
    cells = [f"{tasks[t]['value']:.1%} [{tasks[t]['ci_low']:.1%}, {tasks[t]['ci_high']:.1%}]" for t in results["tasks"]]
    lr = best.get(method, best[lora_best] if "nf4" in method else best["LoRA r16"])
    print(f"| {method} ({lr}) | {seed} | {final[method, seed]:.4f} | " + " | ".join(cells) + " |")
print(f"best LoRA ({lora_best}) over the full SFT, mean final validation loss: "
      f"{results['best_lora_over_full_sft']:.3f}")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

figure, (curves, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
for (method, seed), (_, val, _) in reported.items():
    index = methods.index(method)
    curves.plot(list(val), list(val.values()), marker="o", color=f"C{index}", alpha=0.8,
                label=method if seed == seeds[0] else None)
    if seed != seeds[0]:
        continue
    for offset, task in enumerate(results["tasks"]):
        row = scores[method, seed][task]
        x = offset + (index - (len(methods) - 1) / 2) * 0.8 / len(methods)
        bars.bar(x, row["value"], width=0.8 / len(methods), color=f"C{index}", label=method if offset == 0 else None)
        bars.errorbar(x, row["value"], yerr=[[row["value"] - row["ci_low"]], [row["ci_high"] - row["value"]]],
                      color="black", capsize=3)
curves.set(xlabel="step", ylabel="validation loss (conversations)", yscale="log",
           title=f"{cli.model}, 2 ranks, {cli.steps} steps, seeds {cli.seeds}")
curves.legend(fontsize=8)
bars.set(xticks=range(len(results["tasks"])), xticklabels=results["tasks"], ylabel="greedy accuracy (95% interval)",
         ylim=(0, 1), title=f"evaluate.py, {cli.limit} held-out problems a task, seed {seeds[0]}")
bars.legend(fontsize=8)
figure.savefig(out / "lora_vs_sft.png", dpi=110, bbox_inches="tight")
print(f"results.json and lora_vs_sft.png in {out}")
