"""What context parallelism saves: peak memory per rank at one long bucket, at --cp 1 (one process) and --cp 2 (two).

    python benchmarks/cp_memory.py                              # CPU: small model, 8192 tokens, about 8 minutes
    python benchmarks/cp_memory.py --model qwen2-0.5b --length 16384 --cps 1,2,4

Each run is fsdp2_cp_pretrain.py on the built-in data with a single bucket, one sequence per micro-batch, for --steps
steps; the same run at a bucket of 256 gives the floor (libraries, model, gradients and optimizer state, which CP does
not split). Activation memory is the peak at the long bucket less that floor: with the sequence cut over cp ranks, it
should fall about as 1/cp. Peak memory is the scripts' own per-step figure (metrics.md): on a GPU the CUDA allocator's
peak, on a CPU the process's peak resident set. Prints a table; writes a JSON file.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="small")
parser.add_argument("--length", type=int, default=8192, help="the long bucket: tokens per sequence")
parser.add_argument("--cps", default="1,2", help="the cp degrees, comma-separated; each runs on that many processes")
parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
parser.add_argument("--output", default=None, help="JSON results (default: benchmarks/cp-memory-<date>-<model>.json)")
cli = parser.parse_args()
work = Path(tempfile.mkdtemp(prefix="cp-memory-"))


def peak_per_rank(cp, length):
    """Each rank's peak memory in training (GB, its closing line: the largest of its steps') at one bucket."""
    out = work / f"cp{cp}-{length}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
               "fsdp2_cp_pretrain.py", "--model", cli.model, "--cp", str(cp), "--buckets", str(length),
               "--tokens-per-batch", str(length), "--max-steps", str(cli.steps), "--warmup-steps", "1",
               "--eval-every", str(10**6), "--save-every", str(10**6), "--out-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // cp))}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stderr[-3000:]}")
    peaks = {}
    for line in result.stdout.splitlines():
        if " holds " in line and "peak memory in training" in line:
            peaks[int(line.split()[1])] = float(line.rsplit(" ", 2)[1])
    return [peaks[rank] for rank in sorted(peaks)]


rows = []
for cp in map(int, cli.cps.split(",")):
    long, floor = peak_per_rank(cp, cli.length), peak_per_rank(cp, 256)
    rows.append({"cp": cp, "ranks": cp, "length": cli.length, "peak_gb": long, "floor_gb": floor,
                 "activation_gb": [round(a - b, 2) for a, b in zip(long, floor)]})
    print(f"cp {cp}: peak per rank {long} GB at {cli.length} tokens, floor {floor} GB at 256", flush=True)

print(f"\n| --cp | ranks | peak per rank at {cli.length} tokens | floor at 256 | activation memory per rank |")
print("| --- | --- | --- | --- | --- |")
for row in rows:
    print(f"| {row['cp']} | {row['ranks']} | {', '.join(f'{gb:.2f}' for gb in row['peak_gb'])} GB | "
          f"{', '.join(f'{gb:.2f}' for gb in row['floor_gb'])} GB | "
          f"{', '.join(f'{gb:.2f}' for gb in row['activation_gb'])} GB |")
output = Path(cli.output or REPO / "benchmarks" / f"cp-memory-{datetime.date.today()}-{cli.model}.json")
output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "date": str(datetime.date.today()),
                              "rows": rows}, indent=2))
print(f"wrote {output}")
