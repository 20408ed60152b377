"""Will it fit? Each strategy's memory per rank at each bucket length, measured on a CPU in minutes: every training
script runs its own model build, wrap and training step (`--estimate-memory fake`) on fake tensors, which have shapes
and dtypes but no memory, and a fake process group standing for --gpus ranks; torch's memory tracker counts what the
step allocates, by category. bf16 and the GPU's loss chunk, as the scripts pick them on a GPU (docs/memory.md).

    python estimate_memory.py --model qwen2-0.5b --gpus 4 --gpu-memory 24
    python estimate_memory.py --gpus 8 --gpu-memory 80 --strategies fsdp2 fsdp2-cp --cp 8 --tokens-per-batch 65536
    python estimate_memory.py --gpus 4 --activation-checkpointing selective --reshard-after-forward false
    python estimate_memory.py --gpus 8 --strategies fsdp2-ep --ep 2 --tokens-per-batch 16384   # experts over 2 ranks

Any other flag the training scripts take (--grad-accum, --activation-checkpointing, ...) is passed on to each script
that takes it. On a GPU, --check-on-gpu runs one real step of each estimate on this one GPU (--gpus 1) and prints the
estimate beside torch.cuda.max_memory_allocated and max_memory_reserved. Writes memory.json and memory.png to --out.
"""
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common

REPO = Path(__file__).resolve().parent
# Each row of the table: the script and its flags.
STRATEGIES = {
    "ddp": ["ddp_pretrain.py"],
    "fsdp1": ["fsdp1_pretrain.py"],
    "fsdp2": ["fsdp2_pretrain.py", "--reshard-after-forward", "true"],  # ZeRO-3
    "fsdp2-zero2": ["fsdp2_pretrain.py", "--reshard-after-forward", "false"],
    "fsdp2-tp": ["fsdp2_tp_pretrain.py"],  # --tp
    "fsdp2-cp": ["fsdp2_cp_pretrain.py"],  # --cp
    "fsdp2-3d": ["fsdp2_3d_pretrain.py"],  # --dp-replicate, --cp, --tp
    "fsdp2-muon": ["fsdp2_muon_pretrain.py"],  # Muon's one buffer per matrix, against AdamW's two
    "fsdp2-ep": ["fsdp2_ep_pretrain.py"],  # --model's Mixture of Experts (its -moe preset), the experts over --ep ranks
    "pp": ["pp_pretrain.py"],
    "sft": ["fsdp2_sft.py", "--data", "data/builtin-sft"],
    "sft-lora": ["fsdp2_lora_sft.py", "--data", "data/builtin-sft"],  # --lora-rank passed on; the base frozen
    "grpo": ["fsdp2_grpo.py", "--data", "data/builtin-rl"],  # its training step on replies of the bucket's length
}
# The tracker's categories (torch.distributed._tools: MemTracker's and FSDPMemTracker's), in the table's five.
CATEGORIES = {
    "parameters": ["Parameter", "Sharded Param", "Buffer"],
    "gradients": ["Gradient", "Sharded Grad", "Unsharded Grad", "DDP buckets"],
    "optimizer": ["Optstate", "OptState"],
    "activations": ["Activation", "Inputs"],
    "temporaries": ["Temp", "Unsharded Param", "All Gather", "Reduce Scatter"],
}
GIB = 2 ** 30


def parse_args():
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("--model", default="qwen2-0.5b", choices=list(common.MODEL_PRESETS), help="the preset")
    parser.add_argument("--gpus", type=common.COUNT, default=4, help="ranks (GPUs) the run would have")
    parser.add_argument("--gpu-memory", type=common.number(float, 0.1), default=24.0, help="GiB per GPU")
    parser.add_argument("--margin", type=common.number(float, 0, 1), default=0.1, help="the share of --gpu-memory "
                        "kept for the allocator's cache and fragmentation (--check-on-gpu measures it)")
    parser.add_argument("--buckets", type=common.bucket_lengths, default=[1024, 4096, 16384, 32768],
                        help="comma-separated bucket lengths: a row each")
    parser.add_argument("--tokens-per-batch", type=common.COUNT, default=None, help="tokens per micro-batch per rank, "
                        "at least the largest bucket: each bucket's batch is this // its length (default: one sequence "
                        "per micro-batch, each bucket in a process of its own)")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES),
                        help="the rows' strategies")
    parser.add_argument("--tp", type=common.COUNT, default=2, help="fsdp2-tp's and fsdp2-3d's tensor-parallel degree")
    parser.add_argument("--cp", type=common.COUNT, default=2, help="fsdp2-cp's and fsdp2-3d's context-parallel degree")
    parser.add_argument("--dp-replicate", type=common.COUNT, default=1, help="fsdp2-3d's replicas (HSDP)")
    parser.add_argument("--ep", type=common.COUNT, default=None, help="fsdp2-ep's expert-parallel degree: each rank "
                        "holds 1 / ep of every layer's experts, each sharded over --gpus / ep ranks (default: --gpus)")
    parser.add_argument("--check-on-gpu", action="store_true", help="also one real step on this GPU (--gpus 1)")
    parser.add_argument("--out", default="runs/estimate_memory", help="memory.json and memory.png go here")
    args, passed_on = parser.parse_known_args()
    if {item.split("=")[0] for item in passed_on} & {"--out-dir", "--estimate-memory"}:
        raise common.UsageError("this tool sets each script's --out-dir and --estimate-memory: write to --out instead")
    if args.check_on_gpu and args.gpus != 1:
        raise common.UsageError(f"--check-on-gpu runs on this one GPU: pass --gpus 1, not {args.gpus}")
    if args.check_on_gpu:
        import torch

        if not torch.cuda.is_available():
            raise common.UsageError("--check-on-gpu: this machine has no GPU that torch can use: drop --check-on-gpu")
    return args, passed_on


def takes(script, flag):
    """Whether a training script takes --flag: its own, the shared parser's, or the batch flags' where it adds them."""
    source = (REPO / script).read_text()
    batch_flags = inspect.getsource(common.add_batch_arguments) if "add_batch_arguments" in source else ""
    return f'"{flag}"' in source + inspect.getsource(common.get_parser) + batch_flags


def command(args, strategy, passed_on, mode, buckets, tokens_per_batch, out_dir):
    """The script's command line: the row's flags, this tool's, then each passed-on flag the script takes."""
    script, *flags = STRATEGIES[strategy]
    degree = {"fsdp2-tp": ["--tp", str(args.tp)], "fsdp2-cp": ["--cp", str(args.cp)],
              "fsdp2-3d": ["--dp-replicate", str(args.dp_replicate), "--cp", str(args.cp), "--tp", str(args.tp)],
              "fsdp2-ep": ["--ep", str(args.ep or args.gpus)]}
    degree = degree.get(strategy, [])
    model = f"{args.model}-moe" if strategy == "fsdp2-ep" else args.model  # its active parameters: --model's
    groups, taken = [], []  # the passed-on flags, each with its values
    for item in passed_on:
        groups.append([item]) if item.startswith("--") or not groups else groups[-1].append(item)
    for group in groups:
        taken += group if takes(script, group[0].split("=")[0]) else []
    return [sys.executable, str(REPO / script), *flags, *degree, "--model", model,
            "--buckets", ",".join(map(str, buckets)), "--tokens-per-batch", str(tokens_per_batch),
            "--dtype", "bf16", "--loss-chunk-rows", "4096", "--estimate-memory", mode, "--out-dir", str(out_dir),
            *taken]


def measure(args, strategy, passed_on, mode, buckets, tokens_per_batch, scratch):
    """One script in estimate mode: {"buckets": [...]} from its memory.json, or {"error": its last line}; with the
    process's seconds and peak resident set (GB)."""
    out_dir = Path(tempfile.mkdtemp(dir=scratch))
    env = {**os.environ, "WORLD_SIZE": str(args.gpus), "RANK": "0", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    if mode == "fake":
        env["CUDA_VISIBLE_DEVICES"] = ""  # fake tensors live on the CPU, whatever this machine has
    start, stderr = time.perf_counter(), out_dir / "stderr"
    with open(stderr, "w") as stderr_file:
        process = subprocess.Popen(command(args, strategy, passed_on, mode, buckets, tokens_per_batch, out_dir),
                                   cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr_file)
        _, status, usage = os.wait4(process.pid, 0)
    cost = {"seconds": time.perf_counter() - start, "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}
    if os.waitstatus_to_exitcode(status) != 0:
        lines = [line for line in stderr.read_text().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {os.waitstatus_to_exitcode(status)}", **cost}
    return {**json.loads((out_dir / "memory.json").read_text()), **cost}


def measure_all(args, passed_on, mode, scratch, workers):
    """{strategy: its buckets' results, merged}: one process per bucket, each a micro-batch of one sequence, smallest
    buckets first (a strategy that fails runs no more); or, with --tokens-per-batch, one process per strategy, each
    bucket's micro-batch that many tokens."""
    jobs = [(strategy, [n], n) for n in args.buckets for strategy in args.strategies]
    if args.tokens_per_batch:
        jobs = [(strategy, args.buckets, args.tokens_per_batch) for strategy in args.strategies]
    failed = set()

    def run(job):
        strategy, buckets, tokens_per_batch = job
        if strategy in failed:
            return {"seconds": 0.0, "peak_rss_gb": 0.0}
        result = measure(args, strategy, passed_on, mode, buckets, tokens_per_batch, scratch)
        if "error" in result:
            failed.add(strategy)
        return result

    results = {strategy: {"buckets": [], "seconds": 0.0, "peak_rss_gb": 0.0} for strategy in args.strategies}
    with ThreadPoolExecutor(workers) as pool:
        for (strategy, _, _), result in zip(jobs, pool.map(run, jobs)):
            merged = results[strategy]
            merged["buckets"] += result.get("buckets", [])
            merged["seconds"] += result["seconds"]
            merged["peak_rss_gb"] = max(merged["peak_rss_gb"], result["peak_rss_gb"])
            merged.update({"error": result["error"]} if "error" in result else {})
    return results


def grouped(categories):
    """{table category: bytes} of the tracker's categories at the step's peak, and their total."""
    groups = {group: sum(categories.get(name, 0) for name in names) for group, names in CATEGORIES.items()}
    return {**groups, "total": categories["Total"]}


def print_table(args, results):
    usable = args.gpu_memory * (1 - args.margin)
    batch = f"{args.tokens_per_batch:,} tokens" if args.tokens_per_batch else "one sequence"
    print(f"\n{args.model} on {args.gpus} GPUs of {args.gpu_memory:g} GiB: peak memory per rank in GiB of one training "
          f"step, {batch} per micro-batch, bf16; fits: total <= {usable:.1f} GiB ({args.margin:.0%} kept for the "
          f"allocator)")
    header = ["bucket", *CATEGORIES, "total", "fits"]
    for strategy, result in results.items():
        print(f"\n{strategy}: {' '.join(STRATEGIES[strategy])}")
        if "error" in result:
            print(f"  not measured: {result['error']}")
            continue
        print("  " + "".join(f"{name:>13}" for name in header))
        fitting = []
        for bucket in result["buckets"]:
            groups = grouped(bucket["categories"])
            fits = groups["total"] / GIB <= usable
            fitting += [bucket["bucket_len"]] if fits else []
            print("  " + f"{bucket['bucket_len']:>13,}" + "".join(f"{size / GIB:>13.2f}" for size in groups.values())
                  + f"{'yes' if fits else 'no':>13}")
        print(f"  largest bucket that fits: {max(fitting):,}" if fitting else "  no bucket fits")


def plot(args, results, path):
    if not any(result["buckets"] for result in results.values()):
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for strategy, result in results.items():
        if result["buckets"]:
            axes.plot([b["bucket_len"] for b in result["buckets"]],
                      [b["categories"]["Total"] / GIB for b in result["buckets"]], marker="o", label=strategy)
    axes.axhline(args.gpu_memory, color="black", linestyle="--", label=f"GPU memory ({args.gpu_memory:g} GiB)")
    batch = f"{args.tokens_per_batch:,} tokens" if args.tokens_per_batch else "one sequence"
    axes.set(xscale="log", xlabel="bucket length (tokens)", ylabel="peak memory per rank (GiB)",
             title=f"{args.model}, {args.gpus} GPUs, {batch} per micro-batch")
    axes.set_xticks(args.buckets, [f"{length:,}" for length in args.buckets])
    axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main():
    args, passed_on = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        results = measure_all(args, passed_on, "fake", scratch, os.cpu_count() or 1)
        real = measure_all(args, passed_on, "real", scratch, 1) if args.check_on_gpu else {}  # one GPU: one at a time
    seconds = time.perf_counter() - start
    (out / "memory.json").write_text(json.dumps({"flags": vars(args), "passed_on": passed_on, "estimates": results,
                                                 "on_gpu": real}, indent=1) + "\n")
    plot(args, results, out / "memory.png")
    print_table(args, results)
    if real:
        print("\none real step on this GPU, per bucket: estimate, tracker on the real step, CUDA allocated, reserved "
              "(GiB), and the estimate's error against allocated")
        for strategy, result in real.items():
            if "error" in result or "error" in results[strategy]:
                print(f"  {strategy}: {result.get('error') or results[strategy]['error']}")
                continue
            for estimate, measured in zip(results[strategy]["buckets"], result["buckets"]):
                predicted, allocated = estimate["categories"]["Total"], measured["peak_mem_gb"] * 1e9
                print(f"  {strategy:>12} {estimate['bucket_len']:>7,} {predicted / GIB:>8.2f} "
                      f"{measured['categories']['Total'] / GIB:>8.2f} {allocated / GIB:>8.2f} "
                      f"{measured['peak_reserved_gb'] * 1e9 / GIB:>8.2f} {predicted / allocated - 1:>+8.1%}")
    print(f"\n{len(results)} strategies in {seconds:.0f} s on {os.cpu_count()} cores; the largest process's peak "
          f"resident set {max(result['peak_rss_gb'] for result in results.values()):.2f} GB; memory.json and "
          f"memory.png in {out}")


if __name__ == "__main__":
    main()
