"""What every script measures and logs: MFU against the device's peak, peak memory, the metrics file, and the stop on
a non-finite loss."""
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import common

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity). MFU is reported against these;
# it is null where the device is not listed (CPUs among them).
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12,
    "B200": 2250e12, "MI300X": 1307e12,
}


def device_peak_flops(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""  # no CPU is listed
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def step_peak_memory_gb(device):
    """Peak memory since the last call, so each step's row shows its own: the CUDA allocator's allocated and held (its
    cache and fragmentation on top: what runs out first); on a CPU, the process's peak resident set so far, and None."""
    if device.type == "cuda":
        peaks = torch.cuda.max_memory_allocated(device) / 1e9, torch.cuda.max_memory_reserved(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)  # no wait for the device: the allocator counts on the host
        return peaks
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e9, None


def open_metrics(path, resumed_step):
    """metrics.jsonl, appended to unbuffered: a row is one write, so a reader never meets half of one. On resume, rows
    after the checkpoint's step (a crashed run's, to be trained again) are dropped: every step appears once."""
    path = Path(path)
    if resumed_step is None or not path.exists():
        return open(path, "wb", buffering=0)
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= resumed_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # the last line of a run killed as it wrote it, or a damaged one
            print(f"note: {path}: skipped 1 line that holds no whole row: {line[:60]}", file=sys.stderr)
    path.write_text("".join(kept))
    return open(path, "ab", buffering=0)


class NonFiniteLoss(common.ReportedError):
    """The loss or the gradient norm became inf or NaN: training diverged. Exit status 4."""
    exit_status = 4


def stop_if_nonfinite(step, loss, grad_norm):
    """Called before the optimizer step with the global loss and gradient norm, which every rank holds alike:
    on inf or NaN all ranks stop together here, so the weights, and any later checkpoint, never see it."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    dist.barrier()  # leave the way a finished run does: no rank tears gloo down under another
    dist.destroy_process_group()
    time.sleep(0.2)  # and gloo's threads free the last collectives' tensors before Python exits
    if int(os.environ.get("RANK", 0)) == 0:
        print(file=sys.__stderr__)  # end the progress bar's line
    raise NonFiniteLoss(f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped before the "
                        f"update, no checkpoint was written: lower --lr or raise --warmup-steps")


def estimate_memory(args, model, optimizer, train_step, device, micro_batches):
    """--estimate-memory: per bucket, torch's tracker counts this rank's memory by category over one optimizer step on
    full batches (all targets; micro_batches(rows) of them); rank 0 writes memory.json (in bytes); the process ends."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.modules.module import register_module_forward_pre_hook

    for parameter in filter(lambda p: p.requires_grad, model.parameters()):  # AdamW makes its state in its first step
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    buckets, sharded = [], isinstance(model, FSDPModule)
    for bucket_len in args.buckets:
        tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()
        if not sharded:
            tracker.track_external(model, optimizer)  # FSDPMemTracker finds them itself
        step_peak_memory_gb(device)  # a new peak
        batch = torch.zeros(args.tokens_per_batch // bucket_len, bucket_len, dtype=torch.long, device=device)
        # A tracker follows one forward per module: a global hook (before FSDP's) restarts it at each micro-batch.
        restart = register_module_forward_pre_hook(lambda module, _: tracker.reset_mod_stats() if module is model
                                                   else None)
        # Two micro-batches stand for all: those after the first meet the same memory, and the last syncs the gradients.
        micro = min(micro_batches(len(batch)), 2)
        with tracker:
            train_step([(batch, batch)] * micro, batch.numel() * micro)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        restart.remove()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))  # the categories at the step's peak
        if args.estimate_memory == "fake" and hasattr(model, "reducer"):  # DDP's C++ reducer made its gradient buckets
            peak["DDP buckets"] = sum(map(int, model._get_ddp_logging_data()["bucket_sizes"].split(",")))  # real ones
            peak["Total"] += peak["DDP buckets"]
        buckets.append({"bucket_len": bucket_len, "batch_size": args.tokens_per_batch // bucket_len,
                        "categories": {getattr(kind, "value", kind): size for kind, size in peak.items()},
                        **dict(zip(["peak_mem_gb", "peak_reserved_gb"], step_peak_memory_gb(device)))})
    if dist.get_rank() == 0:
        report = {"flags": common.flag_values(args), "world_size": dist.get_world_size(), "buckets": buckets}
        (Path(args.out_dir) / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.2)  # gloo's threads free the last collectives' tensors before Python exits
    sys.exit(0)
