"""Run fsdp2_muon_pretrain.py unchanged and record its Muon group around each optimizer step, as tests/crash.py runs
the scripts: torch.optim's global step hooks are added, the script runs as __main__.

    MUON_PROBE=steps.pt python tests/muon_probe.py fsdp2_muon_pretrain.py [flags]

Rank 0 writes to MUON_PROBE, per step: the group's learning rate and weight decay, and each matrix whole (its DTensor
gathered) before the step, its gradient, and the matrix after; tests/test_fsdp2_muon_pretrain.py redoes the steps with
torch.optim.Muon.
"""
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parent.parent
steps = []


def muon_group(optimizer):
    return next(group for group in optimizer.param_groups if group.get("muon"))


def before(optimizer, args, kwargs):
    group = muon_group(optimizer)
    steps.append({"lr": group["lr"], "weight_decay": group["weight_decay"],
                  "before": [p.full_tensor().clone() for p in group["params"]],
                  "grads": [p.grad.full_tensor().clone() for p in group["params"]]})


def after(optimizer, args, kwargs):
    steps[-1]["after"] = [p.full_tensor().clone() for p in muon_group(optimizer)["params"]]
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(steps, os.environ["MUON_PROBE"])


register_optimizer_step_pre_hook(before)
register_optimizer_step_post_hook(after)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
