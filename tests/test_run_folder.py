"""One writer per run folder. A run holds an flock on <out-dir>/.lock from before its first collective to its exit: a
second run into the folder is refused in one line that names the holder, and the first goes on unharmed; the tools
that write into a folder refuse one in use alike; metrics.jsonl is written a whole row per write, and its readers skip
a last line cut short. A torchrun launcher killed outright, its workers ending with it: test_crash.py."""
import json
import os
import threading
import time

import pytest

import common
import metrics
import plot
from helpers import TINY_RUN, assert_same_weights_and_moments, check, copy_checkpoint, read_metrics, run_script

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (conftest.py)

SCRIPT = "fsdp2_pretrain.py"


def wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_finishes_as_a_lone_run(tiny_run, tmp_path):
    lone = tiny_run(SCRIPT)[0]
    out, flags = copy_checkpoint(lone, 10, tmp_path / "run"), [*TINY_RUN, "--out-dir", tmp_path / "run", "--resume"]
    first = {}
    writer = threading.Thread(target=lambda: first.update(result=run_script(SCRIPT, *flags, nproc=2)))
    writer.start()
    wait_for(lambda: (out / "metrics.jsonl").is_file() or not writer.is_alive(), 120, "metrics row of the first run")
    holder = (out / ".lock").read_text()
    second = run_script(SCRIPT, *flags, nproc=2)  # the same command again
    still_running = writer.is_alive()
    writer.join()
    check(first["result"])
    assert still_running, "the first run ended before the second was refused: nothing was tested"
    assert second.returncode == 2, second.stderr
    error_lines = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
    assert error_lines == [f"error: --out-dir {out} is in use by {holder.strip()}: wait for that run or stop it, or "
                           f"choose another --out-dir"], second.stderr
    assert holder.startswith("pid ") and (out / ".lock").read_text() == holder  # the refused run wrote nothing there
    # The first run: every metrics line whole, each step once, and the lone run's numbers, weights and moments.
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(11, 21))
    ours, theirs = read_metrics(out)[0], read_metrics(lone)[0]
    assert all(ours[step]["loss"] == pytest.approx(theirs[step]["loss"], abs=1e-6) for step in range(11, 21))
    assert_same_weights_and_moments(out / "checkpoints" / "step_20", lone / "checkpoints" / "step_20", tmp_path)


def test_a_torn_last_line_is_skipped_and_said_once_by_plot_and_by_resume(tmp_path, capsys):
    rows = [{"step": 0, "val_loss": 9.0}, {"step": 1, "loss": 8.0, "tokens": 9}, {"step": 2, "loss": 7.0, "tokens": 9}]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 3, "loss": 6.')  # killed as it wrote step 3
    series = plot.read_run(tmp_path)
    assert series[("loss", "step")] == ([1, 2], [8.0, 7.0])
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"note: {tmp_path / 'metrics.jsonl'}: skipped 1 line"), notes
    with metrics.open_metrics(tmp_path / "metrics.jsonl", 1) as resumed:  # resumed from step 1's checkpoint
        resumed.write(f"{json.dumps({'step': 2, 'loss': 7.5})}\n".encode())
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert (tmp_path / "metrics.jsonl").read_text() == text.rsplit("\n", 2)[0] + "\n" + '{"step": 2, "loss": 7.5}\n'
    (tmp_path / "metrics.jsonl").write_text('[1]\n{"step": 1, "loss": 8.0}\n')  # a damaged line that is JSON
    metrics.open_metrics(tmp_path / "metrics.jsonl", 1).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 8.0}\n'


def test_the_tools_refuse_a_folder_in_use(tiny_run, tmp_path, monkeypatch):
    import export_hf
    import pipeline

    held = common.lock_folder(tmp_path / "pipeline", "--out-dir")  # another open file: another holder, to flock
    with pytest.raises(common.UsageError, match=f"--out-dir {tmp_path / 'pipeline'} is in use by pid {os.getpid()}"):
        monkeypatch.setattr("sys.argv", ["pipeline.py", "--out-dir", str(tmp_path / "pipeline"), "--stages", "eval"])
        pipeline.main()
    held.close()
    with common.lock_folder(tmp_path / ".partial_export", "OUT_DIR"):
        with pytest.raises(common.UsageError, match="OUT_DIR .*partial_export is in use"):
            export_hf.export(tiny_run("ddp_pretrain.py")[0], tmp_path / "export")
    assert not (tmp_path / "export").exists()

