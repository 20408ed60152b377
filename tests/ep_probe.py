"""Run fsdp2_ep_pretrain.py unchanged and record, on each rank, some of its training steps: every router's top-k choices
(the forward's, then, under activation checkpointing, the recompute's in backward), and through torch.optim's global
step hooks the first layer's router and expert weights, whole, with their gradients before the optimizer step and
their values after it.

    EP_PROBE=probe EP_PROBE_STEPS=1,7 python tests/ep_probe.py fsdp2_ep_pretrain.py [flags]

Steps count from this process's first (a resumed run's first is the checkpoint's step + 1; DCP's optimizer step that
makes AdamW's state before a load, with no forward before it, is not one). Each rank writes
probe.step<N>.rank<R>; tests/test_fsdp2_ep_pretrain.py compares them with one process's.
"""
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts, Qwen2MoeTopKRouter

REPO = Path(__file__).resolve().parent.parent
STEPS = {int(step) for step in os.environ.get("EP_PROBE_STEPS", "1").split(",")}
record, modules, done, trained = {"choices": []}, {}, [0], [False]  # steps so far; a training forward since the last


def whole(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def forward(module, inputs, output):
    for kind in (Qwen2MoeTopKRouter, Qwen2MoeExperts):  # (FSDP2 makes the experts an FSDPQwen2MoeExperts)
        if isinstance(module, kind):
            modules.setdefault(kind, module)  # the first layer's
    if isinstance(module, Qwen2MoeTopKRouter) and torch.is_grad_enabled():
        trained[0] = True
        if done[0] + 1 in STEPS:
            record["choices"].append(output[2].detach().clone())


def weights():
    router, experts = modules[Qwen2MoeTopKRouter], modules[Qwen2MoeExperts]
    return {"router": router.weight, "gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}


def before(optimizer, args, kwargs):
    if trained[0] and done[0] + 1 in STEPS:  # every rank gathers (full_tensor is a collective)
        record["grads"] = {name: whole(p.grad) for name, p in weights().items()}


def after(optimizer, args, kwargs):
    if not trained[0]:
        return
    done[0], trained[0] = done[0] + 1, False
    if done[0] in STEPS:
        record["after"] = {name: whole(p) for name, p in weights().items()}
        torch.save(record, f"{os.environ['EP_PROBE']}.step{done[0]}.rank{os.environ.get('RANK', 0)}")
        record.clear()
        record["choices"] = []


register_module_forward_hook(forward)
register_optimizer_step_pre_hook(before)
register_optimizer_step_post_hook(after)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
