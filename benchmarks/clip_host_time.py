"""The host time of clipping tensor-parallel gradients: one DTensor op per tensor (torch's clip_grads_with_norm_ with
foreach=False, as DTensors on two meshes need) against one foreach kernel over the local shards (fsdp2_tp_pretrain.py's
and fsdp2_3d_pretrain.py's way). The model is laid out as fsdp2_tp_pretrain.py lays it out (tp over the ranks, FSDP2
over dp 1), with qwen2-0.5b's 24 layers, 290 tensors, at the tiny preset's widths: the cost per tensor is the host's.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/clip_host_time.py
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import modeling  # noqa: E402

dist.init_process_group("gloo")
tiny = common.MODEL_PRESETS["tiny"]
common.MODEL_PRESETS["tiny-24-layers"] = {**tiny, "model": {**tiny["model"], "num_hidden_layers": 24}}
model = modeling.build_model("tiny-24-layers")
mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
plan = {**{f"self_attn.{name}_proj": ColwiseParallel() for name in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
for layer in model.model.layers:
    parallelize_module(layer, mesh["tp"], plan)
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(model, mesh=mesh["dp"])
parameters = list(model.parameters())
for parameter in parameters:
    parameter.grad = torch.ones_like(parameter)
grad_norm = torch.tensor(0.5)  # below the clip's 1.0: the gradients stay as they are (no denormals), each call alike


def per_tensor():
    torch.nn.utils.clip_grads_with_norm_(parameters, 1.0, grad_norm, foreach=False)


def foreach_over_local_shards():
    local_grads = [parameter.grad.to_local() for parameter in parameters]
    torch._foreach_mul_(local_grads, (1.0 / (grad_norm + 1e-6)).clamp(max=1.0))


# Twice each, alternating; the second round is the one to quote (the first warms the allocator and dispatch caches).
for name, clip in [("one DTensor op per tensor", per_tensor), ("one foreach kernel", foreach_over_local_shards)] * 2:
    for _ in range(5):
        clip()
    start = time.perf_counter()
    for _ in range(50):
        clip()
    if dist.get_rank() == 0:
        print(f"{name}: {len(parameters)} tensors, {(time.perf_counter() - start) / 50 * 1e3:.2f} ms a clip")
dist.barrier()
dist.destroy_process_group()
