"""Run fsdp2_lora_sft.py unchanged and record, on each rank, whether its optimizer steps moved the frozen base: through
torch.optim's global step hooks, every adapted projection's base weight, whole, before the first step and after each.

    LORA_PROBE=probe.json python tests/lora_probe.py fsdp2_lora_sft.py [flags]

Rank 0 writes {"steps", "base_changed" (module ids), "adapters_changed", "adapted"}; tests/test_fsdp2_lora_sft.py
reads it. With LORA_FIRST_STEP=first.pt (one process, one micro-batch), it also saves the first step's batch (the last
one collated before it) and every trainable parameter's value and gradient before that step updates them.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import data  # noqa: E402  (the script's own module: its collate is recorded)

adapted, first, record = {}, {}, {"steps": 0, "base_changed": [], "adapters_changed": 0}
roots, batches, collate = [], [], data.collate


def recorded_collate(*args, **kwargs):
    batches[:] = [collate(*args, **kwargs)]
    return batches[0]


def whole(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def forward(module, inputs, output):
    if type(module).__name__ == "LoRALinear":
        adapted.setdefault(id(module), module)
    if type(module).__name__.endswith("Qwen2WithChunkedLoss") and not roots:  # FSDP2 renames the class
        roots.append(module)


def before(optimizer, args, kwargs):
    if adapted and not first:  # every rank gathers (full_tensor is a collective), in the same order
        first.update({key: (whole(m.base_layer.weight), whole(m.lora_B.weight)) for key, m in adapted.items()})
        if os.environ.get("LORA_FIRST_STEP"):
            trained = {name: p for name, p in roots[0].named_parameters() if p.requires_grad}
            torch.save({"batch": batches[0], "values": {name: whole(p) for name, p in trained.items()},
                        "grads": {name: whole(p.grad) for name, p in trained.items()}}, os.environ["LORA_FIRST_STEP"])


def after(optimizer, args, kwargs):
    if not first:  # DCP's step that gives a fresh AdamW its state before a load: no forward before it
        return
    record["steps"] += 1
    changed = [key for key, m in adapted.items() if not torch.equal(whole(m.base_layer.weight), first[key][0])]
    record["base_changed"] = sorted({*record["base_changed"], *map(str, changed)})
    moved = [not torch.equal(whole(m.lora_B.weight), first[key][1]) for key, m in adapted.items()]
    record["adapters_changed"] = sum(moved)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(os.environ["LORA_PROBE"]).write_text(json.dumps({**record, "adapted": len(adapted)}))


data.collate = recorded_collate
register_module_forward_hook(forward)
register_optimizer_step_pre_hook(before)
register_optimizer_step_post_hook(after)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
