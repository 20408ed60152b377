"""Crashes lose nothing, stop signals lose no step. A rank SIGKILLed mid-run or mid-save, or the torchrun launcher
SIGKILLed (tests/crash.py), ends the whole job within seconds and frees its run folder, leaves the newest complete
checkpoint intact, and --resume then trains exactly the steps the uninterrupted run did. SIGTERM to the launcher, or to
one rank, saves the step in progress on every rank, and --resume auto continues from it exactly. torchrun's restarts
continue a run whose rank died; a save the filesystem refuses is one line, the newest checkpoint whole, and a save that
fails otherwise keeps its own error. --resume auto on a finished run ends at once with status 0; ranks that find
different checkpoints to resume stop in one line before any load.
Each crashed run resumes the shared tiny run's step_10 (as a run restarted after a first crash would) and dies (or is
signalled) at step 12 or in its save of step 20, so it trains a few or ten steps before, not twelve or twenty.
A loss driven to inf/NaN stops every rank before the update, so no checkpoint ever holds it."""
import argparse
import fcntl
import io
import json
import math
import re
import shutil
import time

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import checkpoints
import common
import loading
import metrics
from helpers import (
    BUILTIN_TEXT,
    EXTRA_FLAGS,
    RL_DATA,
    SFT_DATA,
    TINY_RUN,
    assert_same_weights_and_moments,
    check,
    copy_checkpoint,
    read_metrics,
    run_script,
    traceback_through_our_code,
    tree_hashes,
)

CRASHES = {  # script, moment (tests/crash.py's CRASH_AT: counted from the resumed step 10), rank killed
    # step 12: rank 0 sends SIGTERM to torchrun (CRASH_TARGET=launcher), which sends it to its workers: they save a step
    "ddp launcher SIGKILL": ("ddp_pretrain.py", "step:2", 0),  # its workers get SIGKILL from the kernel (common.py)
    "ddp launcher SIGTERM": ("ddp_pretrain.py", "step:2", 0),
    "fsdp2 rank SIGTERM": ("fsdp2_pretrain.py", "step:2", 1),  # step 12: rank 1 alone is signalled; both stop with it
    "fsdp2 mid-save": ("fsdp2_pretrain.py", "save:20", 1),  # model/ written, optimizer/ not
    "pp mid-run": ("pp_pretrain.py", "step:2", 1),  # step 12; 2 stages: the last one dies, the first waits on its sends
    "grpo mid-rollout": ("fsdp2_grpo.py", "rollout:2", 1),  # step 12; rank 0 waits inside its synced generation
}


def flags_of(script, tiny_run):
    """The shared tiny run's flags; GRPO's also name the SFT run it starts from, as conftest's tiny_run does."""
    source = (["--init-from", tiny_run("fsdp2_sft.py")[0], "--eval-generate", 8, *RL_DATA] if script == "fsdp2_grpo.py"
              else [])
    return [*TINY_RUN, *EXTRA_FLAGS.get(script, []), *source]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, tiny_run):
    """crashed(case): (out_dir, CompletedProcess, seconds from the kill to the job's exit, sha256 of step_10's files
    before the run) of TINY_RUN resumed from its step_10 with one rank SIGKILLed; made once per module."""
    runs = {}

    def get(case):
        if case not in runs:
            script, moment, victim = CRASHES[case]
            out = copy_checkpoint(tiny_run(script)[0], 10, tmp_path_factory.mktemp(case.replace(" ", "_")) / "run")
            before = tree_hashes(out / "checkpoints" / "step_10")
            stamp = out.parent / "killed_at"
            target = "launcher" if "launcher" in case else "rank"
            crash_signal = case.split()[-1] if "SIG" in case else "SIGKILL"  # a case named after a signal sends it
            every_step = ["--eval-every", 1] if "SIGTERM" in case else []  # the stopped step is an evaluation step
            result = run_script("tests/crash.py", script, *flags_of(script, tiny_run), *every_step, "--out-dir", out,
                                "--resume", nproc=2, torchrun=True,
                                env={"CRASH_AT": moment, "CRASH_RANK": str(victim), "CRASH_STAMP": str(stamp),
                                     "CRASH_TARGET": target, "CRASH_SIGNAL": crash_signal})
            assert stamp.exists(), f"no rank was killed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            runs[case] = (out, result, time.time() - float(stamp.read_text()), before)
        return runs[case]

    return get


@pytest.mark.parametrize("case", ["ddp launcher SIGKILL", "ddp launcher SIGTERM", "pp mid-run", "grpo mid-rollout"])
def test_a_kill_ends_the_job_with_an_error_within_60_seconds_and_frees_its_run_folder(case, crashed):
    out, result, seconds_after_kill, _ = crashed(case)
    assert result.returncode != 0  # the launcher's own -9, where it was the one killed
    # Every worker is gone (the captured output ends when the last one closes it), and so is the run folder's lock.
    assert seconds_after_kill < 60, f"the job took {seconds_after_kill:.0f} s to end after the kill"
    with open(out / ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while a worker lives on


def stopped_at(result):
    """The step a stop signal saved, from the line the run ends with (None: no signal stopped it)."""
    found = re.search(r"stopped by a signal: step (\d+) is saved", result.stdout)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("case", CRASHES)
def test_a_crash_leaves_the_newest_complete_checkpoint_as_it_was(case, crashed):
    out, result, _, before = crashed(case)
    _, moment, _ = CRASHES[case]
    assert result.returncode != 0 and "step_10 at step 10" in result.stdout  # it resumed, then died
    # A signal: the step whose reduction follows it is saved whole (the signal comes in an optimizer step: that of step
    # 12, or of 11 where DCP's load made a step of its own), though a second one came during the save; a kill: none.
    saved = [f"step_{stopped_at(result)}"] if "SIGTERM" in case else []
    assert saved in ([], ["step_12"], ["step_13"])
    if "rank SIG" in case:  # torchrun was not signalled: it reports its workers' status (the first to exit, at least)
        assert f"exitcode  : {common.STOPPED_BY_SIGNAL} " in result.stderr, result.stderr[-3000:]
    assert [p.name for p in checkpoints.complete_checkpoints(out / "checkpoints")] == ["step_10", *saved]
    for folder in saved:
        checkpoints.read_meta(out / "checkpoints" / folder, "--resume")  # every file of the size it was written
    assert tree_hashes(out / "checkpoints" / "step_10") == before  # every file byte for byte
    if moment.startswith("save"):  # it really died mid-save: the half-written folder is there, never committed
        assert (out / "checkpoints" / ".partial_step_20").is_dir()


@pytest.mark.parametrize("case", [case for case in CRASHES if case != "ddp launcher SIGKILL"])  # resumed as the others
def test_resume_after_a_crash_trains_the_same_steps_as_the_uninterrupted_run(case, crashed, tiny_run, tmp_path):
    crashed_dir, _, _, _ = crashed(case)
    script, _, _ = CRASHES[case]
    out = shutil.copytree(crashed_dir, tmp_path / "run")
    resumed_at = stopped_at(crashed(case)[1]) or 10
    result = check(run_script(script, *flags_of(script, tiny_run), "--out-dir", out, "--resume", "auto", nproc=2))
    assert f"step_{resumed_at} at step {resumed_at}" in result.stdout
    assert not list((out / "checkpoints").glob(".*")), "leftovers of the crashed save were not cleaned up"
    assert [p.name for p in checkpoints.complete_checkpoints(out / "checkpoints")] == [f"step_{resumed_at}", "step_20"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(11, 21))  # the crashed run's rows after step 10 were dropped, each step logged once
    evaluated = [row["step"] for row in rows if "val_loss" in row]
    if "SIGTERM" in case:  # its step saved at once, unevaluated: the resumed run evaluates it first, so none is missing
        assert evaluated == [*range(11, resumed_at + 1), 20]  # (the crashed run evaluated every step from step_10)
    uninterrupted, _ = read_metrics(tiny_run(script)[0])
    resumed, _ = read_metrics(out)
    for step in range(11, 21):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], abs=1e-6)
        assert resumed[step]["grad_norm"] == pytest.approx(uninterrupted[step]["grad_norm"], rel=1e-5)
    # the step-20 checkpoints: weights and AdamW moments too (FSDP1: test_fsdp_pretrain)
    if script == "fsdp2_pretrain.py":
        assert_same_weights_and_moments(out / "checkpoints" / "step_20",
                                        tiny_run(script)[0] / "checkpoints" / "step_20", tmp_path)


def test_torchrun_restarts_the_group_after_a_rank_dies_and_the_run_continues_as_if_uninterrupted(tiny_run, tmp_path):
    """`torchrun --max-restarts 1 ... --resume auto`, as docs/multinode.md runs it: rank 1 SIGKILLed in step 12 of the
    first attempt; the agent restarts both ranks, which continue from step_10 and end with the uninterrupted losses."""
    out = copy_checkpoint(tiny_run("ddp_pretrain.py")[0], 10, tmp_path / "run")
    stamp = tmp_path / "killed_at"
    result = check(run_script("tests/crash.py", "ddp_pretrain.py", *TINY_RUN, "--out-dir", out, "--resume", "auto",
                              nproc=2, torchrun=True, restarts=1,
                              env={"CRASH_AT": "step:2", "CRASH_RANK": "1", "CRASH_STAMP": str(stamp),
                                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))  # a store per attempt (common.py)
    assert stamp.exists() and result.stdout.count("step_10 at step 10") == 2  # both attempts began at step 10
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(11, 21))  # each step once
    uninterrupted, _ = read_metrics(tiny_run("ddp_pretrain.py")[0])
    restarted, _ = read_metrics(out)
    for step in range(11, 21):
        assert restarted[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], abs=1e-6)


def test_max_restarts_over_torchruns_shared_store_is_refused_with_the_variable_that_fixes_it(monkeypatch):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a restarted group meets in the store its dead group used, and can
    read the dead ranks' addresses (pytorch#135712): refused before the process group, in one line."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun gives its workers then
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(common.UsageError, match="--max-restarts.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        common.init_process_group(torch.device("cpu"))


@pytest.mark.parametrize("script,victim", [("ddp_pretrain.py", 0), ("fsdp2_pretrain.py", 1)])  # torch.save; DCP
def test_a_save_the_filesystem_refuses_is_one_line_and_the_newest_checkpoint_stays_whole(script, victim, tiny_run,
                                                                                          tmp_path):
    """A rank may write no file over 4 MB (RLIMIT_FSIZE: its writes fail as on a full disk) from step_10 on: the save of
    step 12 fails in one line, step_10 stays as it was, and is what --resume auto takes next. DDP's other rank, waiting
    for rank 0 at the save's barrier, may see its peer leave before it is stopped: its own error, which says so."""
    out = copy_checkpoint(tiny_run(script)[0], 10, tmp_path / "run")
    before = tree_hashes(out / "checkpoints" / "step_10")
    result = run_script("tests/crash.py", script, *TINY_RUN, "--save-every", 2, "--out-dir", out, "--resume", "auto",
                        nproc=2, env={"CRASH_AT": "fsize:4000000", "CRASH_RANK": str(victim)})
    assert result.returncode == checkpoints.SaveFailed.exit_status == 8
    peer = [line for line in result.stderr.splitlines() if line.startswith(f"[rank{1 - victim}]:")]
    assert not traceback_through_our_code("\n".join(set(result.stderr.splitlines()) - set(peer)))
    assert not peer or "gloo" in peer[-1], peer  # its connection to rank 0 lost (gloo's error), not renamed a disk's
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and f"--out-dir {out}: saving step 12 failed" in error_lines[0], result.stderr
    assert [p.name for p in checkpoints.complete_checkpoints(out / "checkpoints")] == ["step_10"]
    assert tree_hashes(out / "checkpoints" / "step_10") == before
    again = argparse.Namespace(resume="auto", model="tiny", max_steps=20)  # the same command, once there is room
    found = checkpoints.find_resume_checkpoint(again, out / "checkpoints", script.removesuffix(".py"))
    assert found == out / "checkpoints" / "step_10"


@pytest.mark.parametrize("script", ["ddp_pretrain.py", "fsdp1_pretrain.py", "fsdp2_pretrain.py"])
@pytest.mark.slow  # runs of its own
def test_a_disk_that_fills_at_any_byte_of_a_save_gives_the_one_line_and_keeps_the_checkpoint_whole(script, tmp_path):
    """tests/save_sweep.py: step 2's save, repeated with every file capped at byte counts around the end of each file
    step 1 wrote (where torch.save's writer fails with another message at each flush) and spread over the rest, ends
    each time in the one line's SaveFailed, step_1 whole; then step 2 saves."""
    sweep, out = tmp_path / "sweep.json", tmp_path / "run"
    check(run_script("tests/save_sweep.py", script, *TINY_RUN, "--max-steps", 2, "--save-every", 1, "--out-dir", out,
                     env={"SAVE_SWEEP": str(sweep), "SAVE_SWEEP_TAIL": "8", "SAVE_SWEEP_SPREAD": "20"}))
    found = json.loads(sweep.read_text())
    assert found["failures"] == {} and found["limits"] >= 30, found["failures"]
    assert [p.name for p in checkpoints.complete_checkpoints(out / "checkpoints")] == ["step_1", "step_2"]


@pytest.mark.parametrize("limit", [600, 1300])  # config.json (1.1 kB) at the start; metrics.jsonl or TensorBoard's file
@pytest.mark.slow  # runs of its own
def test_a_refused_write_of_the_config_or_the_metrics_is_one_line_too(limit, tmp_path):
    """Outside a save, a write the filesystem refuses (a file-size limit here, in the main thread or TensorBoard's) is
    the same kind of line and status 8, not a traceback."""
    result = run_script("tests/crash.py", "fsdp2_pretrain.py", *TINY_RUN, "--out-dir", tmp_path / "run", nproc=1,
                        torchrun=True, env={"CRASH_AT": f"fsize:{limit}"})  # its output in pipes, which no limit caps
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: a write failed (OSError: [Errno 27]"), result.stderr[-999:]
    assert "exitcode  : 8 " in result.stderr and not traceback_through_our_code(result.stderr)
    assert "Traceback" not in result.stderr.split("error: ")[0]  # nor TensorBoard's thread's


def test_resume_auto_starts_fresh_in_an_empty_folder_and_continues_from_the_newest_checkpoint(tiny_run, tmp_path):
    """One command line for the first launch and every later one (a requeued job): --resume auto."""
    args = argparse.Namespace(resume="auto", model="tiny", max_steps=30)
    assert checkpoints.find_resume_checkpoint(args, tmp_path / "checkpoints", "ddp_pretrain") is None
    run = tiny_run("ddp_pretrain.py")[0] / "checkpoints"
    assert checkpoints.find_resume_checkpoint(args, run, "ddp_pretrain") == run / "step_20"


@pytest.mark.parametrize("script,nproc", [("ddp_pretrain.py", 1), ("fsdp2_pretrain.py", 2)])
@pytest.mark.slow  # multi-process runs of its own
def test_a_nonfinite_loss_stops_every_rank_before_the_update_and_saves_nothing_poisoned(script, nproc, tmp_path):
    # A learning rate of 1e9 makes the first update enormous: the next forward overflows to inf/NaN.
    result = run_script(script, "--model", "tiny", "--data", BUILTIN_TEXT, "--lr", 1e9, "--warmup-steps", 1,
                        "--max-steps", 6, "--save-every", 1, "--eval-every", 100, "--val-fraction", 0.002, "--dtype",
                        "fp32", "--out-dir", tmp_path, nproc=nproc, torchrun=nproc > 1)
    # Its own exit status, not bad input's (2): one process exits with it, torchrun names it for its ranks.
    status = metrics.NonFiniteLoss.exit_status
    assert status == 4 != common.UsageError.exit_status and not traceback_through_our_code(result.stderr)
    assert result.returncode == status if nproc == 1 else f"exitcode  : {status} " in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "--lr" in error_lines[0], result.stderr
    stopped_at = int(re.match(r"error: step (\d+): the loss is (nan|inf)", error_lines[0]).group(1))
    assert stopped_at >= 2
    train, _ = read_metrics(tmp_path)
    assert sorted(train) == list(range(1, stopped_at)) and all(math.isfinite(row["loss"]) for row in train.values())
    saved = checkpoints.complete_checkpoints(tmp_path / "checkpoints")
    assert saved[-1].name == f"step_{stopped_at - 1}" and not list((tmp_path / "checkpoints").glob(".*"))
    model, _ = loading.load_checkpoint_model(saved[-1])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_save_that_fails_for_another_reason_keeps_its_own_error(tmp_path):
    """Only the filesystem's refusal (an OSError, anything raised inside torch.save) is the one-line SaveFailed: a
    dead peer, a timed-out collective, a full GPU or a bug keep their own error, DCP's wrapper around them too."""
    others = [torch.distributed.DistBackendError("the peer died"), torch.distributed.DistNetworkError("timed out"),
              torch.OutOfMemoryError("no memory"), RuntimeError("a bug"),
              CheckpointException("save", {1: (torch.distributed.DistBackendError("the peer died"), None)})]
    for error in others:
        with pytest.raises(type(error)) as raised, checkpoints.report_failure(tmp_path, 12):
            raise error
        assert raised.value is error
    class FullDisk(io.BytesIO):  # refuses every write past 300 bytes, in words torch.save's writer never uses
        def write(self, data):
            if self.tell() > 300:
                raise RuntimeError("the disk refused it")
            return super().write(data)

    refusals = [OSError(28, "No space left on device"), CheckpointException("save", {1: (OSError(27, "big"), None)})]
    for refusal in [*refusals, None]:  # None: whatever torch.save raises as it writes (its message varies by the byte)
        with pytest.raises(checkpoints.SaveFailed, match=f"--out-dir {tmp_path}: saving step 12 failed"), \
                checkpoints.report_failure(tmp_path, 12):
            if refusal is None:
                torch.save({"weights": torch.zeros(1000)}, FullDisk())
            raise refusal


def test_resume_auto_on_a_finished_run_ends_at_once_with_status_0_and_writes_nothing(tiny_run, tmp_path):
    """A requeued job, or a restarted group, whose run had saved its last step: one line and status 0; an explicit
    --resume at that checkpoint is still bad input (nothing to train)."""
    out = tmp_path / "run"
    shutil.copytree(tiny_run("ddp_pretrain.py")[0], out)
    before = tree_hashes(out)
    result = check(run_script("ddp_pretrain.py", *TINY_RUN, "--out-dir", out, "--resume", "auto", nproc=2))
    last = out / "checkpoints" / "step_20"
    assert result.stdout.splitlines() == [f"already finished at step 20 ({last}): nothing to train"]
    assert tree_hashes(out) == before
    refused = run_script("ddp_pretrain.py", *TINY_RUN, "--out-dir", out, "--resume", last)
    assert refused.returncode == 2 and "nothing to train: raise --max-steps" in refused.stderr


def test_ranks_that_find_different_checkpoints_stop_in_one_line_before_loading(tiny_run, tmp_path):
    """Rank 1's listing without the newest checkpoint, as a shared filesystem's cache on another node can be: the
    ranks compare their choices before any load and stop in one line, the checkpoint error's status. Under --resume
    auto the run is finished in rank 0's listing and not in rank 1's: no rank ends on its own view. --init-from a run
    folder (its newest checkpoint) is compared the same way."""
    out, source = tmp_path / "run", tiny_run("fsdp2_pretrain.py")[0]
    shutil.copytree(tiny_run("ddp_pretrain.py")[0] / "checkpoints", out / "checkpoints")
    before = {folder: tree_hashes(folder / "checkpoints") for folder in (out, source)}
    cases = [("ddp_pretrain.py", ["--resume", "auto"], out, out),
             ("fsdp2_sft.py", [*SFT_DATA, "--init-from", source], source, tmp_path / "sft")]
    for script, flags, found, out_dir in cases:
        result = run_script("tests/crash.py", script, *TINY_RUN, *flags, "--out-dir", out_dir, nproc=2,
                            env={"CRASH_AT": "listing:1", "CRASH_RANK": "1"})
        assert result.returncode == checkpoints.CheckpointError.exit_status == 3, result.stderr[-2000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith("error: the ranks found different checkpoints ("), errors
        assert f"{found / 'checkpoints' / 'step_10'}, {found / 'checkpoints' / 'step_20'}" in errors[0]
        assert not traceback_through_our_code(result.stderr) and not (out_dir / "metrics.jsonl").exists()
    assert {folder: tree_hashes(folder / "checkpoints") for folder in (out, source)} == before
