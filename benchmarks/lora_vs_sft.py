"""What LoRA gives up: fsdp2_sft.py against fsdp2_lora_sft.py at ranks 8, 16 and 64 on the CPU, from the same
midtrained base (pipeline.py's pretrain and mid stages), the same data (the SFT's, 10% pretraining text replayed) and
the same steps. Each method runs at three learning rates; the one with the lowest final validation loss on the
conversations is scored by evaluate.py on held-out problems, with 95% intervals.

    python benchmarks/lora_vs_sft.py --out runs/lora_vs_sft           # small preset, 2 ranks, 600 steps a run

Writes results.json and lora_vs_sft.png (validation loss against step, each method at its best rate; accuracy with
intervals) into --out; prints a table. A finished run is read, not run again, while its command, the repository's
Python files, the data and the versions are the same; a failed run prints its stderr's end and stops the benchmark.
"""
import argparse
import json
import sys
from pathlib import Path

from runs import finite, run_once

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/lora_vs_sft")
parser.add_argument("--model", default="small")
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--sft-lrs", default="1e-3,3e-3,1e-2", help="full SFT's learning rates (the preset's: 3e-3)")
parser.add_argument("--lora-lrs", default="3e-3,1e-2,3e-2", help="LoRA's: adapters usually take a higher rate")
parser.add_argument("--ranks", default="8,16,64")
parser.add_argument("--tasks", default="arith_gen,arith_reworded,solve")
parser.add_argument("--limit", type=int, default=200, help="evaluate.py's --limit: problems a task")
cli = parser.parse_args()
out = Path(cli.out)
out.mkdir(parents=True, exist_ok=True)


base = out / "base"  # pipeline.py's pretraining and midtraining: the model every method finetunes
run_once(base, [sys.executable, "pipeline.py", "--stages", "pretrain,mid", "--model", cli.model, "--seed", "0",
                "--out-dir", str(base)], ["data/builtin", "data/builtin-sft"])
methods = {"full SFT": ("fsdp2_sft.py", [], cli.sft_lrs.split(","))}
methods.update({f"LoRA r{rank}": ("fsdp2_lora_sft.py", ["--lora-rank", rank, "--lora-alpha", str(2 * int(rank))],
                                  cli.lora_lrs.split(",")) for rank in cli.ranks.split(",")})


def finetune(method, lr):
    """A run's validation losses on the conversations {step: loss} (the replayed text's left out) and its seconds a
    step (evaluations included), from its metrics."""
    script, flags, _ = methods[method]
    folder = out / f"{method.replace(' ', '-')}-lr{lr}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, "--model",
               cli.model, "--init-from", str(base / "mid"), "--replay", "data/builtin:0.1", "--lr", lr, "--seed", "0",
               "--max-steps", str(cli.steps), "--eval-every", str(cli.steps // 6), "--save-every", str(cli.steps),
               "--eval-generate", "0", "--out-dir", str(folder)] + flags
    run_once(folder, command, ["data/builtin", "data/builtin-sft", base / "mid" / "checkpoints"])
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    conversations = next(name for name in rows[-1] if name.startswith("val_loss/"))  # the first split: the SFT set's
    return folder, {row["step"]: row[conversations] for row in rows if conversations in row}, steps[-1][
        "elapsed_s"] / len(steps)


sweep = {(method, lr): finetune(method, lr) for method, (_, _, lrs) in methods.items() for lr in lrs}


best = {method: min(lrs, key=lambda lr: finite(sweep[method, lr][1][cli.steps]))  # a NaN never the best
        for method, (_, _, lrs) in methods.items()}
scores = {}
for method, lr in best.items():
    folder = sweep[method, lr][0]
    scored = folder / "eval" / "eval.jsonl"
    command = [sys.executable, "evaluate.py", str(folder), "--tasks", cli.tasks, "--limit", str(cli.limit), "--out",
               str(scored)]
    run_once(scored.parent, command, [folder / "checkpoints"])
    scores[method] = {row["task"]: row for row in map(json.loads, scored.read_text().splitlines())
                      if row["metric"] == "accuracy"}

results = {"model": cli.model, "steps": cli.steps, "best_lr": best, "tasks": cli.tasks.split(","), "limit": cli.limit,
           "sweep": {f"{m} {lr}": {"final_val_loss": v[cli.steps], "s_per_step": t} for (m, lr), (_, v, t) in
                     sweep.items()}, "accuracy": scores}
(out / "results.json").write_text(json.dumps(results, indent=1))
print(f"{'method':>10} {'lr':>6} final val loss, s a step (evaluations included)")
for (method, lr), (_, val, seconds) in sweep.items():
    print(f"{method:>10} {lr:>6} {val[cli.steps]:.4f} {seconds:.2f}{'  best' if best[method] == lr else ''}")
print("| method (best lr) | " + " | ".join(results["tasks"]) + " |")
for method, tasks in scores.items():
    cells = [f"{tasks[t]['value']:.1%} [{tasks[t]['ci_low']:.1%}, {tasks[t]['ci_high']:.1%}]" for t in results["tasks"]]
    print(f"| {method} ({best[method]}) | " + " | ".join(cells) + " |")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

figure, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
for index, method in enumerate(methods):
    val = sweep[method, best[method]][1]
    curves.plot(list(val), list(val.values()), marker="o", color=f"C{index}", label=f"{method}, lr {best[method]}")
    for offset, task in enumerate(results["tasks"]):
        row = scores[method][task]
        x = offset + (index - (len(methods) - 1) / 2) * 0.8 / len(methods)
        bars.bar(x, row["value"], width=0.8 / len(methods), color=f"C{index}", label=method if offset == 0 else None)
        bars.errorbar(x, row["value"], yerr=[[row["value"] - row["ci_low"]], [row["ci_high"] - row["value"]]],
                      color="black", capsize=3)
curves.set(xlabel="step", ylabel="validation loss", title=f"{cli.model}, 2 ranks, {cli.steps} steps, seed 0")
curves.legend()
bars.set(xticks=range(len(results["tasks"])), xticklabels=results["tasks"], ylabel="greedy accuracy (95% interval)",
         ylim=(0, 1), title=f"evaluate.py, {cli.limit} held-out problems a task")
bars.legend()
figure.savefig(out / "lora_vs_sft.png", dpi=110, bbox_inches="tight")
print(f"results.json and lora_vs_sft.png in {out}")
