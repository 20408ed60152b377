"""Run a training script and repeat one of its saves under many file-size limits, as a disk that fills at any byte:

    SAVE_SWEEP=sweep.json python tests/save_sweep.py SCRIPT.py [flags] --max-steps 2 --save-every 1

The save of step 1 is the script's own. At step 2, before its own save, the script's save_checkpoint runs again and
again inside checkpoints.report_failure, each time with RLIMIT_FSIZE's soft limit at one byte count: every byte count
of the last SAVE_SWEEP_TAIL (64) of each file step 1 wrote and one past it, and SAVE_SWEEP_SPREAD (100) spread over
the rest of it (a tenth as many in a file over 1 MB). Each must end in SaveFailed (the one line, status 8) and leave
step_1 whole; SAVE_SWEEP gets {"limits": how many, "sizes": step_1's file sizes, "failures": {limit: what else it ended
in}, "reasons": {limit: the refused write's error}}. The script is not modified: this file wraps
checkpoints.report_failure, then runs the script as __main__ (its save's code reached through the calling frame).
"""
import json
import os
import resource
import runpy
import shutil
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import checkpoints  # noqa: E402

real_report_failure, calls = checkpoints.report_failure, []


TAIL, SPREAD = int(os.environ.get("SAVE_SWEEP_TAIL", 64)), int(os.environ.get("SAVE_SWEEP_SPREAD", 100))


def limits_around(sizes):
    """The byte counts to cap every file at: every byte of each file's last TAIL and one past (a writer's last flush
    and its close), and SPREAD spread over the rest of it (a tenth as many in a file over 1 MB); each below the largest
    file's size, so that some file always fails and nothing is committed."""
    found = set()
    for size in sizes:
        spread = range(0, size, max(1, size // (SPREAD if size < 1_000_000 else SPREAD // 10 or 1)))
        found.update(limit for limit in [*spread, *range(size - TAIL, size + 2)] if 0 < limit < max(sizes))
    return sorted(found)


def report_failure(out_dir, step):
    calls.append(step)
    if len(calls) == 2:  # step 1 is committed: sweep step 2's save
        script_globals = sys._getframe(1).f_globals
        save_checkpoint, data_position = script_globals["save_checkpoint"], script_globals["data_position"]
        first = checkpoints.complete_checkpoints(Path(out_dir) / "checkpoints")[0]
        sizes = {**checkpoints.read_meta(first, "--resume")["files"], "meta.json": (first / "meta.json").stat().st_size}
        script_globals["writer"].flush()  # TensorBoard's thread writes its rows now, not under a limit below
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        failures, reasons = {}, {}
        for limit in limits_around(sizes.values()):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                with real_report_failure(out_dir, step):
                    save_checkpoint(step, data_position)
                failures[limit] = "saved"  # cannot be: some file is larger than the limit
            except checkpoints.SaveFailed as error:
                reasons[limit] = str(error).split(" failed (")[1].split(";")[0][:60]
            except BaseException:  # what the sweep is for: anything but the one line
                failures[limit] = traceback.format_exc()[-2000:]
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            checkpoints.read_meta(first, "--resume")  # step_1 whole: every file of its size
        shutil.rmtree(Path(out_dir) / "checkpoints" / f".partial_step_{step}", ignore_errors=True)
        Path(os.environ["SAVE_SWEEP"]).write_text(json.dumps({"limits": len(limits_around(sizes.values())),
                                                              "sizes": sizes, "failures": failures,
                                                              "reasons": reasons}))
    return real_report_failure(out_dir, step)


checkpoints.report_failure = report_failure
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
