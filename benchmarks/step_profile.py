"""Run a training script (or the bare loop) unchanged under torch.profiler for a few steady-state steps, as the tests'
probes run the scripts: a library hook is added, the script runs as __main__ (benchmarks/gpu_check.py runs it).

    torchrun --standalone --nproc_per_node=1 benchmarks/step_profile.py --steps 32-34 --out DIR fsdp2_pretrain.py ...

Each optimizer step ends a profiler step (torch.optim's global step hook), so a profiled step runs from the end of one
optimizer step to the end of the next: the loop's logging, then the step. Steps FIRST to LAST are recorded (the step
before them warms the profiler up). Rank 0 writes DIR/trace.json.gz (chrome://tracing or ui.perfetto.dev) and
DIR/profile.json: per step, the wall time, the share of it in which the GPU runs a kernel or a copy (busy), the rest
(idle: what the GPU waits for the host), the longest such gap, the calls that wait for the GPU (cudaStreamSynchronize
and its kin), the kernel launches and the aten operators the host dispatches (a CPU's count of the step's host work),
the host's time in optimizer.step(); and the operators that take the most GPU time (on a CPU: host time).
"""
import argparse
import gzip
import json
import os
import runpy
import shutil
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

REPO = Path(__file__).resolve().parent.parent
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", required=True, help="FIRST-LAST: the optimizer steps to record, counted from 1")
parser.add_argument("--out", required=True, help="the folder for trace.json.gz and profile.json")
parser.add_argument("command", nargs=argparse.REMAINDER, help="the script to run, then its own flags")
cli = parser.parse_args()
first, last = map(int, cli.steps.split("-"))
out = Path(cli.out)
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of what runs on the GPU


def busy_time(intervals, start, end):
    """Microseconds of [start, end] covered by the union of the (start, end) intervals."""
    covered, reached = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reached), min(b, end)
        if b > a:
            covered, reached = covered + b - a, b
    return covered


def longest_gap(intervals, start, end):
    """The longest stretch of [start, end] that no interval covers, in microseconds."""
    gap, reached = 0.0, start
    for a, b in sorted(intervals):
        if a > reached:
            gap = max(gap, min(a, end) - reached)
        reached = max(reached, b)
    return max(gap, end - reached) if reached < end else gap


def summarize(profiler):
    """on_trace_ready: the trace written, then reduced to profile.json; a failure is one line, and the run goes on."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    try:
        write_profile(profiler)
    except Exception as error:  # the run's own figures still count
        print(f"step_profile: no profile: {type(error).__name__}: {error}", file=sys.stderr, flush=True)


def write_profile(profiler):
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = [event for event in json.loads(trace.read_text())["traceEvents"] if "dur" in event]
    steps = sorted((event["ts"], event["ts"] + event["dur"]) for event in events
                   if event["name"].startswith("ProfilerStep#"))
    start, end, n_steps = steps[0][0], steps[-1][1], len(steps)
    gpu = [(event["ts"], event["ts"] + event["dur"]) for event in events if event.get("cat") in GPU_WORK]
    runtime = [event["name"] for event in events if event.get("cat") in ("cuda_runtime", "cuda_driver")
               and start <= event["ts"] <= end]
    busy = busy_time(gpu, start, end) if gpu else None
    on_gpu = torch.cuda.is_available()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    operators = sorted((average for average in profiler.key_averages() if not average.key.startswith("ProfilerStep")),
                       key=lambda average: -getattr(average, key))[:8]  # the steps' own spans are not operators
    summary = {
        "steps": [first, last], "step_ms": (end - start) / n_steps / 1e3,
        "step_ms_each": [(b - a) / 1e3 for a, b in steps],
        "gpu_busy": busy / (end - start) if busy is not None else None,
        "gpu_idle_ms": (end - start - busy) / n_steps / 1e3 if busy is not None else None,
        "longest_gpu_gap_ms": longest_gap(gpu, start, end) / 1e3 if gpu else None,
        "syncs": sum("Synchronize" in name for name in runtime) / n_steps,
        "launches": sum("LaunchKernel" in name or "GraphLaunch" in name for name in runtime) / n_steps,
        "aten_ops": sum(event.get("cat") == "cpu_op" and event["name"].startswith("aten::")
                        and start <= event["ts"] <= end for event in events) / n_steps,  # nested ones too
        "optimizer_ms": sum(event["dur"] for event in events if event["name"].startswith("Optimizer.step#")
                            and start <= event["ts"] <= end) / n_steps / 1e3,  # the host's time in optimizer.step()
        "top_operators": [{"name": average.key, "ms_per_step": getattr(average, key) / n_steps / 1e3,
                           "calls_per_step": average.count / n_steps} for average in operators],
        "time_of": "GPU" if on_gpu else "host",
    }
    (out / "profile.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(trace, "rb") as source, gzip.open(out / "trace.json.gz", "wb") as target:
        shutil.copyfileobj(source, target)
    trace.unlink()


# Profiler step 0 runs from here to the end of optimizer step 1, profiler step k is training step k + 1.
profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                   schedule=schedule(wait=first - 2, warmup=1, active=last - first + 1, repeat=1),
                   on_trace_ready=summarize)
register_optimizer_step_post_hook(lambda optimizer, args, kwargs: profiler.step())
profiler.start()
script = str(REPO / cli.command[0])
sys.argv = [script, *cli.command[1:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
