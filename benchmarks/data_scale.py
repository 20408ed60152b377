"""The data path at scale, measured: preparation speed and memory, index and schedule build times, each rank's
anonymous memory when training starts, and resume time against the step. Prints one table (BENCHMARKS.md).

    python benchmarks/make_corpus.py --tokens 1e9 --out-dir /tmp/corpus-1B
    python benchmarks/data_scale.py --corpus /tmp/corpus-1B --work-dir /tmp/data-scale

Steps: prepare the corpus with 1 and with 2 workers (tokens/s, the peak resident memory of the whole process tree,
sha256 of both outputs); build the index and one epoch's schedule of the prepared corpus for qwen2-0.5b's buckets,
and of a synthetic 11M-document index; start fsdp2_pretrain.py (2 ranks, small model, 3 steps) on the prepared
corpus and on builtin, reading each rank's RssAnon (anonymous memory: the memory-mapped tokens are file pages and
count in RSS, not here) every 0.1 s; resume a tiny run from step 10 and from step 300. --skip-prepare reuses
the folders of an earlier run.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
import data  # noqa: E402
import loading  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--corpus", required=True, help="a folder of parquet shards (benchmarks/make_corpus.py)")
parser.add_argument("--work-dir", required=True, help="prepared folders and runs go here")
parser.add_argument("--skip-prepare", action="store_true", help="reuse the prepared folders of an earlier run")
parser.add_argument("--only-prepare", action="store_true", help="measure the preparation only")
cli = parser.parse_args()
work = Path(cli.work_dir)
work.mkdir(parents=True, exist_ok=True)
env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
rows = []


def status(pid, field):
    """A /proc/PID/status field in bytes (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def proportional(pid):
    """Proportional set size in bytes: shared pages (the forked workers share the parent's) split among their
    sharers."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def descendants(pid):
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [grandchild for child in children for grandchild in descendants(child)]


def run_watched(command, watch):
    """Run command; every 0.1 s call watch(pid of the command). Returns (seconds, stdout)."""
    start = time.perf_counter()
    command = [str(part) for part in command]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    while process.poll() is None:
        watch(process.pid)
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    stdout = process.stdout.read()
    if process.returncode != 0:
        sys.exit(f"{' '.join(map(str, command))} failed ({process.returncode}):\n{stdout[-3000:]}")
    return seconds, stdout


# ---------------------------------------------------------------------------------------------- preparation
digests = {}
for workers in (1, 2):
    out = work / f"prepared-{workers}"
    if not cli.skip_prepare:
        peak = {"tree": 0, "process": 0, "pss": 0}

        def watch(pid):
            sizes = [status(p, "VmRSS") for p in [pid, *descendants(pid)]]
            peak.update(tree=max(peak["tree"], sum(sizes)), process=max(peak["process"], max(sizes)),
                        pss=max(peak["pss"], sum(proportional(p) for p in [pid, *descendants(pid)])))

        subprocess.run(["rm", "-rf", str(out)], check=True)
        seconds, stdout = run_watched([sys.executable, "prepare_data.py", "--data", cli.corpus, "--out-dir", out,
                                       "--workers", workers], watch)
        tokens = json.loads((out / "meta.json").read_text())["tokens"]
        rows.append((f"prepare, {workers} worker{'s' * (workers > 1)}",
                     f"{tokens / seconds / 1e6:.2f}M tokens/s ({tokens:,} tokens, {seconds:.0f} s)",
                     f"peak RSS {peak['tree'] / 1e9:.2f} GB all processes (PSS {peak['pss'] / 1e9:.2f} GB), "
                     f"{peak['process'] / 1e9:.2f} GB the largest"))
    digests[workers] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()[:16]
                        for name in ("tokens.bin", "doc_offsets.npy")}
rows.append(("same bytes for 1 and 2 workers", str(digests[1] == digests[2]), json.dumps(digests[2])))
if cli.only_prepare:
    sys.exit("\n".join(f"{name}: {figure}; {detail}" for name, figure, detail in rows))

# ---------------------------------------------------------------------------------------------- index and schedule
parser = common.get_parser("", "runs/x")
args = common.parse_args(parser, loading.script_presets("ddp_pretrain.py"), ["--model", "qwen2-0.5b"])
args = common.finalize_args(args, None)
args.data = [str(work / "prepared-2")]
start = time.perf_counter()
train, val = data.load_pretraining_data(args)
index_seconds = time.perf_counter() - start
start = time.perf_counter()
schedule = data.epoch_schedule(train.lengths, args.buckets, args.tokens_per_batch, 8, 1, args.seed, 0)
rows.append(("index + schedule, prepared corpus", f"{index_seconds + time.perf_counter() - start:.2f} s",
             f"{len(train.lengths):,} samples, {len(schedule):,} steps of 8 ranks (index {index_seconds:.2f} s)"))

rng = np.random.default_rng(0)
lengths = np.clip(rng.lognormal(np.log(500), 1.1, size=11_000_000), 8, 200_000).astype(np.int64)
corpus = data.Corpus(None, np.concatenate([[0], np.cumsum(lengths)]), None, False, "")
start = time.perf_counter()
is_val = np.zeros(len(lengths), dtype=bool)
is_val[common.validation_documents(len(lengths), args.val_fraction)] = True
starts, sample_lengths = data.document_samples(corpus, np.flatnonzero(~is_val), 2048)
schedule = data.epoch_schedule(sample_lengths, args.buckets, args.tokens_per_batch, 8, 1, args.seed, 0)
rows.append(("index + schedule, 11M synthetic documents", f"{time.perf_counter() - start:.2f} s",
             f"{len(sample_lengths):,} samples, {len(schedule):,} steps"))

# ------------------------------------------------------------------------------------------ memory when training starts
train_flags = ["--model", "small", "--buckets", "256,512,1024,2048", "--tokens-per-batch", 2048, "--max-steps", 3,
               "--eval-every", 1000, "--save-every", 1000, "--val-fraction", 1e-6]
anonymous = {}
subprocess.run([sys.executable, "prepare_data.py"], check=True)  # data/builtin
for name, source in [("builtin", "data/builtin"), ("1B corpus", work / "prepared-2")]:
    peak = {}

    def watch(pid):
        for child in descendants(pid):  # the agent's children are the ranks
            peak[child] = max(peak.get(child, 0), status(child, "RssAnon"))

    subprocess.run(["rm", "-rf", str(work / f"run-{name}")], check=True)
    run_watched([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "fsdp2_pretrain.py", "--data", source, *train_flags, "--out-dir", work / f"run-{name}"], watch)
    anonymous[name] = sorted(peak.values())[-2:]  # the two ranks: the largest processes under the agent
rows.append(("RssAnon per rank, builtin", " / ".join(f"{b / 1e6:.0f} MB" for b in anonymous["builtin"]),
             "fsdp2_pretrain.py, 2 ranks, small, 3 steps"))
rows.append(("RssAnon per rank, 1B corpus", " / ".join(f"{b / 1e6:.0f} MB" for b in anonymous["1B corpus"]),
             f"+{(max(anonymous['1B corpus']) - max(anonymous['builtin'])) / 1e6:.0f} MB over builtin"))

# ----------------------------------------------------------------------------------------- resume time against the step
tiny = ["--model", "tiny", "--data", "data/builtin", "--val-fraction", 0.002,
        "--eval-every", 10_000]
resume_dir = work / "resume"
subprocess.run(["rm", "-rf", str(resume_dir)], check=True)
run_watched([sys.executable, "ddp_pretrain.py", *tiny, "--max-steps", 300, "--save-every", 10, "--keep-last", 100,
             "--out-dir", resume_dir], lambda pid: None)
for step in (10, 300):
    seconds, _ = run_watched([sys.executable, "ddp_pretrain.py", *tiny, "--max-steps", step + 1,
                              "--out-dir", work / f"resumed-{step}",
                              "--resume", resume_dir / "checkpoints" / f"step_{step}"], lambda pid: None)
    rows.append((f"resume from step {step}, train 1 step", f"{seconds:.1f} s",
                 "ddp_pretrain.py, 1 process, tiny, builtin (wall time)"))

width = max(len(name) for name, _, _ in rows)
print(f"\n{'what':<{width}}  {'figure':<44}  detail")
for name, figure, detail in rows:
    print(f"{name:<{width}}  {figure:<44}  {detail}")
