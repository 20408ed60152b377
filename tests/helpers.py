"""Launch the training scripts (under torchrun as a user does, as plain python, or as the ranks torchrun would start)
and read what they write."""
import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The tests' data, prepared once and kept across sessions while its source is the same (prepare_test_data), in the
# folder conftest.py names: pytest's cache.
DATA_ROOT = Path(os.environ.get("LLM_REFERENCE_TEST_DATA", Path(tempfile.gettempdir()) / "llm-reference-test-data"))
TINY_CORPUS, TINY_DATA = DATA_ROOT / "tiny_corpus.jsonl", DATA_ROOT / "tiny_corpus"  # the rows; their prepared folder
BUILTIN_TEXT, BUILTIN_SFT, BUILTIN_RL = DATA_ROOT / "builtin", DATA_ROOT / "builtin-sft", DATA_ROOT / "builtin-rl"
# The run most tests share: tiny model, 20 steps, checkpoints at steps 10 and 20, fp32, one validation document
# (evaluation dominates a tiny run on CPU), 256 tokens a micro-batch (the 50,304-row vocabulary's logits are most of a
# step's work: half the preset's tokens, about half the time). Its corpus is small on purpose: an epoch is 12 steps,
# so every resume from step 10 crosses an epoch boundary.
TINY_RUN = ["--model", "tiny", "--data", TINY_DATA, "--max-steps", 20, "--save-every", 10, "--eval-every", 10,
            "--dtype", "fp32", "--val-fraction", 0.002, "--tokens-per-batch", 256]

SFT_DATA = ["--data", BUILTIN_SFT]  # after TINY_RUN's flags: the SFT trains on the built-in reasoning set
RL_DATA = ["--data", BUILTIN_RL]  # and GRPO on the built-in problems
# The shared run's own flags, after TINY_RUN's: two micro-batches, so that tensor and context parallelism (dp 1) and
# a pipeline of two stages (which 1F1B fills with two micro-batches at least) compare with DDP on one process,
# --grad-accum 2; GRPO's rollouts in micro-batches of the preset's 512 tokens (its time is sampling's).
EXTRA_FLAGS = {"fsdp2_tp_pretrain.py": ["--grad-accum", 2], "pp_pretrain.py": ["--grad-accum", 2],
               "fsdp2_cp_pretrain.py": ["--grad-accum", 2], "fsdp2_grpo.py": ["--tokens-per-batch", 512]}


def prepare_folder(source, kind, folder, workers=1):
    """prepare_data.py's own code, in this process: SOURCE (a path or 'builtin') tokenized into FOLDER as KIND
    ("pretrain", "sft" or "rl"); a folder that holds it already is kept. Returns its meta."""
    import argparse

    import prepare_data

    args = argparse.Namespace(data=str(source), data_config=None, text_field="text", max_docs=0)
    return prepare_data.prepare(args, kind, folder, workers=workers, progress=False)


def prepare_test_data():
    """TINY_CORPUS: the first 80 paragraphs of CPython's help topics (about 4,000 tokens), one document each, rewritten
    only when its text changes; it and the built-in sets prepared by prepare_data.py's own code, each kept while it
    holds its source's tokens (the source's size and modification time, for a file)."""
    import pydoc_data.topics

    import common
    import prepare_data

    topics = pydoc_data.topics.topics
    paragraphs = [p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if len(p.strip()) > 40][:80]
    text = "".join(json.dumps({"text": paragraph}) + "\n" for paragraph in paragraphs)
    if not TINY_CORPUS.is_file() or TINY_CORPUS.read_text() != text:
        TINY_CORPUS.parent.mkdir(parents=True, exist_ok=True)
        TINY_CORPUS.write_text(text)
    for source, kind, folder in [(TINY_CORPUS, "pretrain", TINY_DATA), ("builtin", "pretrain", BUILTIN_TEXT),
                                 ("builtin", "sft", BUILTIN_SFT), ("builtin", "rl", BUILTIN_RL)]:
        try:
            prepare_folder(source, kind, folder, workers=prepare_data.available_cores())
        except common.UsageError:  # prepared from an earlier source (the file rewritten, another Python): again
            shutil.rmtree(folder)
            prepare_folder(source, kind, folder, workers=prepare_data.available_cores())


def run_script(script, *flags, nproc=1, torchrun=False, timeout=600, env=None, restarts=0):
    """Run SCRIPT with FLAGS on NPROC CPU ranks (gloo); returns a CompletedProcess (text output). torchrun=True: under
    `torchrun --standalone --max-restarts RESTARTS`, as a user runs it, for what torchrun itself does (a dead rank
    ends the job, its exit report, its restarts). Otherwise one rank is `python SCRIPT.py` (the scripts make it a
    process group of one), and more are NPROC such processes given the variables torchrun gives its workers and
    stopped together when one fails, as torchrun stops them; each forked by tests/zygote.py, its imports made
    (start_process)."""
    full_env = {**os.environ, **BASE_ENV, **(env or {})}
    command = [str(REPO / script), *map(str, flags)]
    if torchrun:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   f"--max-restarts={restarts}", *command]
        return subprocess.run([PYTHON, *command], cwd=REPO, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    return run_ranks(command, nproc, full_env, timeout)


BASE_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}  # every run's, over ours
# What the scripts and the tests' wrappers read when they run, not when they import: a run may set these and still be
# forked by the zygote, whose imports saw the suite's environment. PYTEST_CURRENT_TEST: pytest's, new in every test.
RUN_TIME_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TP_PROBE", "PP_PROBE", "CP_PROBE", "EP_PROBE", "EP_PROBE_STEPS", "SYNC_PROBE", "ROLLOUTS",
                      "CRASH_AT", "CRASH_RANK", "CRASH_STAMP", "CRASH_TARGET", "CRASH_SIGNAL", "PYTEST_CURRENT_TEST",
                      "SAVE_SWEEP", "SAVE_SWEEP_TAIL", "SAVE_SWEEP_SPREAD"}
ZYGOTE = {}  # tests/zygote.py once started: its process, socket and environment
ZYGOTE_LOCK = threading.Lock()


def start_process(command, env, stdout, stderr):
    """`python COMMAND` with ENV, writing into the files STDOUT and STDERR: forked by the zygote (Forked) where ENV
    differs from the zygote's only in RUN_TIME_VARIABLES, else a fresh process."""
    with ZYGOTE_LOCK:
        if not ZYGOTE:
            # A short path: a Unix socket's is at most 107 bytes.
            folder = Path(tempfile.mkdtemp(prefix="zygote-", dir="/tmp" if os.path.isdir("/tmp") else None))
            atexit.register(shutil.rmtree, folder, True)
            zygote_env = {**os.environ, **BASE_ENV}
            with open(folder / "stderr", "w") as zygote_stderr:
                process = subprocess.Popen([PYTHON, str(REPO / "tests" / "zygote.py"), str(folder / "socket")],
                                           cwd=REPO, env=zygote_env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=zygote_stderr)
            ZYGOTE.update(process=process, socket=folder / "socket", env=zygote_env)
            atexit.register(process.kill)
    differing = {key for key in env.keys() | ZYGOTE["env"].keys() if env.get(key) != ZYGOTE["env"].get(key)}
    if differing <= RUN_TIME_VARIABLES and ZYGOTE["process"].poll() is None:
        try:
            return Forked([PYTHON, *command], env, stdout, stderr)
        except (OSError, ValueError):  # no zygote to answer (its stderr file says why): a fresh process does the same
            pass
    with open(stdout, "w") as out, open(stderr, "w") as err:
        return subprocess.Popen([PYTHON, *command], cwd=REPO, env=env, stdout=out, stderr=err)


class Forked:
    """A run forked by tests/zygote.py, with what run_ranks uses of a Popen: pid, poll(), kill() and returncode."""

    def __init__(self, command, env, stdout, stderr):
        deadline = time.monotonic() + 120  # the zygote's imports, once
        while not ZYGOTE["socket"].exists() and time.monotonic() < deadline and ZYGOTE["process"].poll() is None:
            time.sleep(0.05)
        self.connection = socket.socket(socket.AF_UNIX)
        self.connection.connect(str(ZYGOTE["socket"]))
        run = {"argv": command[1:], "env": env, "cwd": str(REPO), "stdout": str(stdout), "stderr": str(stderr)}
        self.connection.sendall((json.dumps(run) + "\n").encode())
        self.replies = self.connection.makefile()
        self.pid, self.returncode = int(self.replies.readline()), None

    def poll(self):
        if self.returncode is None and select.select([self.connection], [], [], 0)[0]:
            self.returncode = int(self.replies.readline())
            self.connection.close()
        return self.returncode

    def kill(self):
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it has ended and the zygote has yet to send its status
                pass


def free_port():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def run_ranks(command, nproc, env, timeout):
    """`python COMMAND` as ranks 0..NPROC-1 of one process group on this machine (one rank: a plain run, no group
    variables); stdout and stderr are rank 0's, then rank 1's, and so on; the exit status the first failed rank's (0 if
    none failed)."""
    group = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    folder = Path(tempfile.mkdtemp(prefix="run-"))
    outputs = [(folder / f"{rank}.stdout", folder / f"{rank}.stderr") for rank in range(nproc)]
    ranks = [start_process(command, env if nproc == 1 else {**env, **group, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                           stdout, stderr)
             for rank, (stdout, stderr) in enumerate(outputs)]
    deadline, failed, timed_out = time.monotonic() + timeout, None, False
    while any(rank.poll() is None for rank in ranks):
        failed = failed or next((rank for rank in ranks if rank.returncode not in (None, 0)), None)
        timed_out = time.monotonic() > deadline
        if failed or timed_out:  # as torchrun: a failed rank stops the others
            for rank in ranks:
                rank.kill()
        time.sleep(0.02)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout)
    failed = failed or next((rank for rank in ranks if rank.returncode != 0), None)
    # A rank stopped before its process began writes no file: it said nothing.
    texts = [[path.read_text() if path.is_file() else "" for path in paths] for paths in outputs]
    shutil.rmtree(folder)
    return subprocess.CompletedProcess([PYTHON, *command], failed.returncode if failed else 0,
                                       "".join(stdout for stdout, _ in texts), "".join(stderr for _, stderr in texts))


def run_parity(*argv):
    """parity.py's main with ARGV, in this process, its torchrun launches made by run_script (the same ranks, forked
    with their imports made): a CompletedProcess of its exit status and what it printed."""
    import contextlib
    import io

    import pytest

    import parity

    def torchrun(command, **kwargs):  # python -m torch.distributed.run --standalone --nproc_per_node=N script ...
        return run_script(command[5], *command[6:], nproc=int(command[4].split("=")[1]))

    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    with (pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout),
          contextlib.redirect_stderr(stderr)):
        patch.setattr(parity.subprocess, "run", torchrun)
        patch.setattr(sys, "argv", ["parity.py", *map(str, argv)])
        try:
            parity.main()
        except SystemExit as exit:
            status = exit.code
    return subprocess.CompletedProcess(["parity.py", *argv], status, stdout.getvalue(), stderr.getvalue())


def check(result):
    """The run succeeded; show its output if it did not."""
    assert result.returncode == 0, (f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
                                    f"\n--- stderr\n{result.stderr[-6000:]}")
    return result


def shown(reply_text):
    """What generate.py prints of a reply: its text, or nothing where that is whitespace only (it says so on stderr)."""
    return reply_text if reply_text.strip() else ""


def reply_saying(answer):
    """The token ids of a reply "The answer is ANSWER." between the solution markers, then its end marker."""
    import common

    text = f"<|begin_of_solution|>\n\nThe answer is {answer}.\n\n<|end_of_solution|>"
    return (common.get_chat_tokenizer().encode(text, allowed_special=set(common.REASONING_MARKERS))
            + [common.SPECIAL_TOKENS[common.END_OF_TURN]])


def read_metrics(out_dir):
    """({step: training row}, {step: validation loss}) of a run: parity.py's reader."""
    import parity

    return parity.read_steps(out_dir)


def assert_same_steps(run, reference, steps, loss_tolerance, grad_norm_tolerance):
    """parity.py's comparison over STEPS: the same buckets, and the losses and grad norms within the tolerances
    (relative where the reference's value is above 1); prints the largest differences and returns the reference's
    rows (for what a test checks beyond)."""
    import parity

    found = parity.compare(run, reference, steps)
    loss, grad_norm = found["max |loss - ref|"], found["max |grad norm - ref|"]
    print(f"largest differences: loss {loss:.1e}, grad norm {grad_norm:.1e}")
    assert loss <= loss_tolerance and grad_norm <= grad_norm_tolerance, found
    return read_metrics(reference)[0]


def copy_checkpoint(run_dir, step, new_run_dir):
    """A new --out-dir holding only checkpoint step_<STEP> of RUN_DIR, to --resume from."""
    shutil.copytree(Path(run_dir) / "checkpoints" / f"step_{step}", Path(new_run_dir) / "checkpoints" / f"step_{step}")
    return Path(new_run_dir)


def tree_hashes(folder):
    """sha256 of every file under FOLDER but run folders' .lock files (which every run into the folder rewrites, a
    refused one aside): equal before and after means nothing was touched."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != ".lock"}


def tree_stats(folder):
    """Size and modification time of every file under FOLDER, and every folder's name (a .lock made in one changes its
    time), .lock files aside: what any write, creation or removal changes, read in a millisecond where tree_hashes reads
    every byte."""
    return {str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns) if path.is_file() else None
            for path in sorted(Path(folder).rglob("*")) if path.name != ".lock"}


def traceback_through_our_code(output):
    """Whether OUTPUT holds a traceback frame in one of the project's scripts (torchrun's own report does not,
    nor do frames of a virtual environment that lives inside the repository)."""
    return re.search(rf'File "{re.escape(str(REPO))}/\w+\.py"', output) is not None


def model_tensors(checkpoint_dir, tmp_path):
    """The model's whole tensors of an FSDP2 checkpoint folder (its model/), read as one process reads DCP."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{checkpoint_dir.parent.parent.name}-{checkpoint_dir.name}.pt"
    dcp_to_torch_save(checkpoint_dir / "model", target)
    return torch.load(target, weights_only=True)


def checkpoint_tensors(checkpoint_dir, tmp_path):
    """Every tensor of a DCP checkpoint folder (FSDP1: one app state; FSDP2: model/ and optimizer/), flattened."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        elif torch.is_tensor(value):
            flat[prefix] = value

    parts = [p for p in ("model", "optimizer") if (checkpoint_dir / p).is_dir()] or [""]
    for part in parts:
        target = tmp_path / f"{checkpoint_dir.parent.parent.name}-{part or 'app'}.pt"
        dcp_to_torch_save(checkpoint_dir / part, target)
        walk(part, torch.load(target, weights_only=True))
    return flat


def assert_same_weights_and_moments(checkpoint_dir, expected_dir, tmp_path):
    """Weights AND AdamW moments of two checkpoints are the same (a resume that lost the moments would differ)."""
    import torch

    expected, actual = checkpoint_tensors(expected_dir, tmp_path), checkpoint_tensors(checkpoint_dir, tmp_path)
    moments = [name for name in expected if name.endswith(("exp_avg", "exp_avg_sq"))]
    assert len(moments) == 2 * 26  # two moments for each of tiny's 26 parameters (the tied head shares one)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


class ReachedACollective(Exception):
    """Raised where the script would start its process group: no bad input may get that far."""


def run_until_the_first_collective(script, flags, world_size, monkeypatch):
    """The script's code in this process, as rank 0 of world_size, until it would start its process group
    (common.init_process_group raises ReachedACollective instead); returns (exit code, what it printed to stderr)."""
    import contextlib
    import io
    import runpy

    import common

    def stop(device, fake):
        raise ReachedACollective(script)

    monkeypatch.setattr(common, "init_process_group", stop)
    locks, lock_folder = [], common.lock_folder
    monkeypatch.setattr(common, "lock_folder", lambda *args: locks.append(lock_folder(*args)) or locks[-1])
    monkeypatch.setattr(sys, "argv", [script, *flags])
    monkeypatch.chdir(REPO)  # relative paths (the defaults runs/..., data/...) as from a checkout's root
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size)}.items():
        monkeypatch.setenv(name, value)
    stderr = io.StringIO()
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        with contextlib.redirect_stderr(stderr):
            runpy.run_path(str(REPO / script), run_name="__main__")
    except common.ReportedError as error:  # what sys.excepthook prints and exits with, as the command line shows
        return error.exit_status, f"error: {error}\n"
    except SystemExit as exit:  # argparse
        return exit.code, stderr.getvalue()
    finally:
        for lock in locks:  # the run folder's lock, released as the script's process would release it at exit
            lock.close()
        for signum, handler in handlers.items():  # the script noted stop signals (common.note_stop_signals): pytest's
            signal.signal(signum, handler)
    raise AssertionError(f"{script} {flags}: no error before its first collective")
