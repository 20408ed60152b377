"""A Mixture of Experts against the dense model of its active size on the CPU, and what expert parallelism moves.

    python benchmarks/moe_vs_dense.py --out runs/moe_vs_dense        # small-moe and small, 2 ranks, 300 steps a run

1. Dense against MoE: fsdp2_pretrain.py --model small and fsdp2_ep_pretrain.py --model small-moe (ep 2; 7.43M
   parameters active per token against 7.42M, 9.20M in all), the same buckets, batches and tokens, the presets' learning
   rate, three seeds each: validation loss against step and against wall time.
2. Balance: small-moe with --aux-loss-coef 0 (seed 0) beside the seed-0 run with the balance loss: each layer's tokens
   per expert, max / mean, over training (1 is perfectly even).
3. Bytes: the all-to-all bytes each rank sends per step as the dispatch counts them (small-moe, 10 steps, activation
   checkpointing off, so a step's forward runs once) beside the formula for that step's tokens: tokens x top-k x hidden
   x 4 bytes x (ep - 1) / ep, for the dispatch and the combine, in every layer. Backward sends the same again.

Writes results.json, curves.png and balance.png into --out; prints the tables. A finished run is read, not run again,
while its command, the repository's Python files, the data and the versions are the same (runs.py); a failed run
prints its stderr's end and stops the benchmark.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

from runs import run_once

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import modeling  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/moe_vs_dense")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--seeds", default="0,1,2")
parser.add_argument("--buckets", default="32,64,128,256", help="both models' (small-moe's preset)")
cli = parser.parse_args()
out = Path(cli.out)
seeds = [int(seed) for seed in cli.seeds.split(",")]


def run(name, script, flags, nproc=2):
    """A run's rows (its metrics.jsonl), run once per command, code, data and versions (runs.py)."""
    folder = out / name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
               *flags, "--buckets", cli.buckets, "--out-dir", str(folder)]
    run_once(folder, command, ["data/builtin"])
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def training(script, model, seed, *flags):
    return run(f"{model}-seed{seed}{''.join(flags)}", script,
               ["--model", model, "--seed", str(seed), "--max-steps", str(cli.steps), "--eval-every",
                str(cli.eval_every), "--save-every", str(cli.steps), *flags])


def curve(rows):
    """{step: validation loss} and {step: seconds since the start} of a run."""
    train = {row["step"]: row["elapsed_s"] for row in rows if "loss" in row}
    return {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}, {0: 0.0, **train}


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # Student's t, two-sided 95%, by degrees of freedom


def mean_and_interval(values):
    half = T_975[len(values) - 1] * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
    return statistics.mean(values), half


# 1. Dense against MoE, and 2. the balance loss's effect.
runs = {(kind, seed): curve(training(script, model, seed)) for kind, script, model in
        (("dense", "fsdp2_pretrain.py", "small"), ("moe", "fsdp2_ep_pretrain.py", "small-moe")) for seed in seeds}
balanced = training("fsdp2_ep_pretrain.py", "small-moe", seeds[0])
unbalanced = training("fsdp2_ep_pretrain.py", "small-moe", seeds[0], "--aux-loss-coef", "0")
results = {"steps": cli.steps, "seeds": seeds, "buckets": cli.buckets}
print(f"final validation loss at step {cli.steps} and seconds a step (evaluations included), mean over seeds "
      f"{cli.seeds} +- 95% interval (t)")
for kind in ("dense", "moe"):
    finals = [runs[kind, seed][0][cli.steps] for seed in seeds]
    seconds = [runs[kind, seed][1][cli.steps] / cli.steps for seed in seeds]
    (loss, loss_half), (second, second_half) = mean_and_interval(finals), mean_and_interval(seconds)
    results[kind] = {"final_val_loss": finals, "mean": loss, "interval_95": loss_half, "s_per_step": seconds,
                     "s_per_step_mean": second, "s_per_step_interval_95": second_half}
    print(f"{kind:>6} {loss:.4f} +- {loss_half:.4f}   {second:.3f} +- {second_half:.3f} s")
gap = [runs["dense", seed][0][cli.steps] - runs["moe", seed][0][cli.steps] for seed in seeds]
results["dense_minus_moe"], results["dense_minus_moe_interval_95"] = mean_and_interval(gap)
print(f"dense - MoE, paired by seed: {results['dense_minus_moe']:+.4f} +- {results['dense_minus_moe_interval_95']:.4f}")
last_row = next(row for row in reversed(balanced) if "loss" in row)
layers = sorted((key for key in last_row if key.startswith("expert_load/")), key=lambda key: int(key.split("/")[1]))
for name, rows in (("with the balance loss", balanced), ("--aux-loss-coef 0", unbalanced)):
    train = [row for row in rows if "loss" in row]
    last = train[-50:]
    loads = [statistics.mean(row[layer] for row in last) for layer in layers]
    results[f"expert_load, last 50 steps, {name}"] = loads
    print(f"tokens per expert, max / mean, each layer, mean of the last 50 steps, {name}: "
          + ", ".join(f"{load:.2f}" for load in loads))

# 3. Bytes: each rank's all-to-all sends per step against the formula.
hidden, (_, experts) = modeling.MODEL_PRESETS["small"]["model"]["hidden_size"], modeling.MOE_PRESETS["small-moe"]
n_layers = modeling.MODEL_PRESETS["small"]["model"]["num_hidden_layers"]
results["bytes"] = []
print("all-to-all megabytes each rank sends in a step's forward (dispatch and combine, every layer): counted, the "
      "formula at even routing, counted / formula")
for world, ep in ((2, 2), (4, 2), (4, 4)):
    flags = ["--model", "small-moe", "--ep", str(ep), "--max-steps", "10", "--eval-every", "100", "--save-every",
             "100", "--activation-checkpointing", "none", "--seed", "0"]
    rows = [row for row in run(f"bytes-world{world}-ep{ep}", "fsdp2_ep_pretrain.py", flags, nproc=world)
            if "loss" in row]
    per_rank_tokens = [row["padded_tokens"] / world for row in rows]
    formula = [tokens * experts["num_experts_per_tok"] * hidden * 4 * (ep - 1) / ep * 2 * n_layers / 1e6
               for tokens in per_rank_tokens]
    counted = [row["all_to_all_mb"] for row in rows]
    ratio = statistics.mean(c / f for c, f in zip(counted, formula))
    results["bytes"].append({"world": world, "ep": ep, "counted_mb": counted, "formula_mb": formula,
                             "counted_over_formula": ratio})
    print(f"world {world}, ep {ep}: {statistics.mean(counted):.3f} MB counted (rank 0), {statistics.mean(formula):.3f} "
          f"MB by the formula, {ratio:.3f}")
(out / "results.json").write_text(json.dumps(results, indent=1))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(13, 4.5))
for (kind, seed), (val, elapsed) in runs.items():
    colour, label = ("C0", "dense small") if kind == "dense" else ("C1", "MoE small-moe, ep 2")
    by_step.plot(list(val), list(val.values()), color=colour, alpha=0.8, label=label if seed == seeds[0] else None)
    by_time.plot([elapsed[step] for step in val], list(val.values()), color=colour, alpha=0.8,
                 label=label if seed == seeds[0] else None)
late = [loss for val, _ in runs.values() for step, loss in val.items() if step >= cli.steps // 10]
for axes, xlabel in ((by_step, "step"), (by_time, "seconds (2 CPU ranks)")):
    axes.set(xlabel=xlabel, ylabel="validation loss", ylim=(min(late) - 0.1, max(late) + 0.1),
             title=f"7.4M active parameters, same tokens, seeds {cli.seeds}")
    axes.legend()
figure.savefig(out / "curves.png", dpi=110, bbox_inches="tight")
figure, axes = plt.subplots(figsize=(8, 4.5))
for (name, rows), style in zip((("balance loss 0.01", balanced), ("no balance loss", unbalanced)), ("-", ":")):
    train = [row for row in rows if "loss" in row]
    for i, layer in enumerate(layers):
        axes.plot([row["step"] for row in train], [row[layer] for row in train], style, color=f"C{i}", alpha=0.8,
                  label=f"layer {layer.split('/')[1]}, {name}")
axes.set(xlabel="step", ylabel="tokens per expert: max / mean", title="small-moe, 8 experts, top 2, seed 0")
axes.legend(fontsize=7, ncol=2)
figure.savefig(out / "balance.png", dpi=110, bbox_inches="tight")
print(f"results.json, curves.png and balance.png in {out}")
