"""Run a training script and SIGKILL one of its ranks at a chosen moment, as a preempted node or an OOM kill would:

    CRASH_RANK=1 CRASH_AT=step:5 torchrun --nproc_per_node=2 tests/crash.py SCRIPT.py [flags]

CRASH_AT is `step:N` (just before this process's Nth optimizer step), `rollout:N` (fsdp2_grpo.py: in the middle of
this process's Nth step's sampling, the other ranks inside their synced generation) or `save:N` (in the middle of
writing checkpoint step_N: DDP's rank 0 dies with half of checkpoint.pt written; under DCP, the rank dies as it starts
the last dcp.save into the folder, the optimizer's for FSDP2). Just before dying, the rank writes the time to
CRASH_STAMP, so a test can measure how long the rest of the job takes to notice. CRASH_TARGET=launcher: the rank
SIGKILLs its parent, the torchrun launcher, instead of itself (the workers are then left to end on their own).
CRASH_SIGNAL=SIGTERM (or another name) sends that signal instead of SIGKILL, and the rank trains on; as it then saves a
checkpoint, it sends itself the same signal again, as a second signal during the save. Under `torchrun --max-restarts`
only the first attempt (TORCHELASTIC_RESTART_COUNT 0) is crashed. CRASH_AT=fsize:BYTES limits the size of any file the
rank writes (RLIMIT_FSIZE, as a full disk would: the write fails); CRASH_AT=listing:N leaves the N newest checkpoints
out of the rank's listing of --out-dir, as a shared filesystem's cached listing on another node could. The scripts are
not modified: this file patches the library calls they make, then runs the script as __main__.
"""
import io
import os
import resource
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parent.parent
kind, number = os.environ["CRASH_AT"].split(":")
is_victim = (int(os.environ.get("RANK", 0)) == int(os.environ.get("CRASH_RANK", 0))
             and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
target_folder = f".partial_step_{number}"
crash_signal = getattr(signal, os.environ.get("CRASH_SIGNAL", "SIGKILL"))


def die():
    Path(os.environ["CRASH_STAMP"]).write_text(str(time.time()))
    os.kill(os.getppid() if os.environ.get("CRASH_TARGET") == "launcher" else os.getpid(), crash_signal)
    if crash_signal == signal.SIGKILL:
        time.sleep(60)  # the launcher's death ends this process too (common.py), or the test sees that it did not


if is_victim and crash_signal != signal.SIGKILL:  # a second signal as the checkpoint is written
    real_save = torch.save

    def save_signalled_again(obj, path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and Path(path).parent.name.startswith(".partial_step_"):
            os.kill(os.getpid(), crash_signal)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save_signalled_again

if is_victim and kind == "fsize":
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(number), int(number)))

if is_victim and kind == "listing":
    sys.path.insert(0, str(REPO))
    import checkpoints

    real_complete_checkpoints = checkpoints.complete_checkpoints

    def complete_checkpoints(checkpoint_root):
        found = real_complete_checkpoints(checkpoint_root)
        return found[:len(found) - int(number)]

    checkpoints.complete_checkpoints = complete_checkpoints


if is_victim and kind == "step":
    steps = 0

    def before_step(optimizer, args, kwargs):
        global steps
        steps += 1
        if steps == int(number):
            die()

    register_optimizer_step_pre_hook(before_step)

if is_victim and kind == "rollout":
    sys.path.insert(0, str(REPO))
    import modeling

    real_generate_replies, rollouts = modeling.generate_replies, 0

    def generate_replies(model, prompts, max_new_tokens, temperature=0.0, *args, **kwargs):
        global rollouts
        rollouts += temperature > 0  # sampling: a rollout, not the greedy evaluation
        if rollouts == int(number):
            die()
        return real_generate_replies(model, prompts, max_new_tokens, temperature, *args, **kwargs)

    modeling.generate_replies = generate_replies

if is_victim and kind == "save":
    real_torch_save, real_dcp_save = torch.save, dcp.save

    def torch_save(obj, path, *args, **kwargs):
        # DCP saves to streams
        is_target = isinstance(path, (str, os.PathLike)) and Path(path).parent.name == target_folder
        if is_target and Path(path).name == "checkpoint.pt":
            buffer = io.BytesIO()
            real_torch_save(obj, buffer, *args, **kwargs)
            Path(path).write_bytes(buffer.getvalue()[:buffer.tell() // 2])  # half the file, then the lights go out
            die()
        return real_torch_save(obj, path, *args, **kwargs)

    def dcp_save(state_dict, *args, checkpoint_id=None, **kwargs):
        folder = Path(checkpoint_id)
        if target_folder in (folder.name, folder.parent.name) and folder.name != "model":  # FSDP2: model/ is done
            die()
        return real_dcp_save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)

    torch.save, dcp.save = torch_save, dcp_save

script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
