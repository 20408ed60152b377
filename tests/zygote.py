"""A process that has made the imports every script makes, then forks one child per run: a run of a script without
torchrun starts here in a tenth of a second, where a fresh `python SCRIPT` spends about 4 s importing torch and
transformers before its first line of work (tests/helpers.py's run_script starts it and sends it the runs).

    python tests/zygote.py SOCKET          # serves until the process that started it ends

Each run is one line of JSON on a connection to SOCKET: argv, env, cwd and the files for stdout and stderr. The
child is that run as `python SCRIPT` runs it: its own environment (plus what the imports set, as they would set it),
working directory, sys.argv and sys.path, `__main__`, output files, uncaught-exception hook and exit status; the
zygote answers the child's pid, then its exit status as Popen gives it (-N for signal N). Only what the imports read
from the environment at import time is the zygote's: helpers.py starts a fresh process for a run whose environment
differs there (TORCH_LOGS, say).
"""
import gc
import json
import os
import runpy
import selectors
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
base_path = sys.path[1:]  # without this file's folder: each child puts its script's folder first, as python does
base_env = dict(os.environ)
sys.path.insert(0, str(REPO))
import torch  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401
import torch.utils.tensorboard  # noqa: E402,F401
import tqdm  # noqa: E402,F401

import checkpoints  # noqa: E402,F401  (common with it)
import data  # noqa: E402,F401
import grading  # noqa: E402,F401
import loading  # noqa: E402,F401
import metrics  # noqa: E402,F401
import modeling  # noqa: E402,F401  (transformers' Qwen2 with it)
import tasks  # noqa: E402,F401

set_by_imports = {key: value for key, value in os.environ.items() if base_env.get(key) != value}
# The imports' objects, which every child inherits, leave the collector's view: a child's collections and its exit
# then neither walk them nor copy their pages (Python's documented use of gc.freeze before fork).
gc.freeze()


def serve(path):
    """Accept runs until the parent ends; returns only in a forked child, with its run."""
    parent, children = os.getppid(), {}  # children: pid -> the connection that waits for its exit status
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.02):
            connection, _ = listener.accept()
            run = json.loads(connection.makefile().readline())
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                connection.close()
                return run
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection
        for pid in list(children):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                connection = children.pop(pid)
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                connection.close()
    sys.exit(0)


run = serve(sys.argv[1])
os.environ.clear()
os.environ.update({**run["env"], **set_by_imports})
os.chdir(run["cwd"])
for fd, name in ((1, "stdout"), (2, "stderr")):
    target = os.open(run[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(target, fd)
    os.close(target)
sys.argv = run["argv"]
sys.path[:] = [str(Path(sys.argv[0]).resolve().parent), *base_path]
runpy.run_path(sys.argv[0], run_name="__main__")
