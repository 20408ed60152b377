"""Run a training script unchanged and count what its training steps wait on the device for, as tests/crash.py runs
the scripts: library hooks are added, the script runs as __main__ (another probe may come first: it runs the script).

    SYNC_PROBE=probe.json torchrun --nproc_per_node=2 tests/sync_probe.py SCRIPT [flags]

Counted from the end of optimizer step 2 to the end of step 5 (SYNC_STEPS=2-5), outside torch.no_grad (rollouts and
evaluations read every generated token by nature): on CUDA, every operation that torch.cuda.set_sync_debug_mode("warn")
reports, by the Python line that calls it; on a CPU, the calls that would wait on a GPU: a tensor's value read on the
host (.item(), .tolist(), bool, int, float, format, numpy) and an output whose shape hangs on values (nonzero). Rank 0
writes to SYNC_PROBE a list of {name: count}, one per counted step.
"""
import json
import os
import runpy
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parent.parent
FIRST, LAST = map(int, os.environ.get("SYNC_STEPS", "2-5").split("-"))
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "numpy", "nonzero"}
steps, finished = [], [0]  # finished: the optimizer steps so far


class HostReads(TorchFunctionMode):
    """Counts into steps[-1] the calls of HOST_READS made with gradients enabled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and torch.is_grad_enabled():
            steps[-1][name] += 1
        return func(*args, **(kwargs or {}))


def on_sync_warning(message, category, filename, lineno, *rest):  # CUDA: set_sync_debug_mode's, at the Python line
    if torch.is_grad_enabled():
        steps[-1][f"{Path(filename).name}:{lineno}"] += 1


mode = HostReads()


def after_step(optimizer, args, kwargs):
    finished[0] += 1
    if finished[0] == FIRST:  # the window opens: steps FIRST + 1 to LAST are counted
        if torch.cuda.is_available():  # the mode first: turning it on warns once that it is a prototype
            torch.cuda.set_sync_debug_mode("warn")
            warnings.simplefilter("always")
            warnings.showwarning = on_sync_warning
        else:
            mode.__enter__()
    if FIRST <= finished[0] < LAST:
        steps.append(Counter())
    elif finished[0] == LAST:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        else:
            mode.__exit__(None, None, None)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(os.environ["SYNC_PROBE"]).write_text(json.dumps(steps))


register_optimizer_step_post_hook(after_step)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
