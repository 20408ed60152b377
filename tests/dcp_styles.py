"""Worker of tests/test_dcp_styles.py, run under torchrun (gloo): DCP's two checkpoint styles with both FSDPs.

For each of FSDP1 and FSDP2 and each style ("separate": model and optimizer saved apart; "app": one Stateful app
state), on the tiny model: train 3 steps, save, train 3 more (the reference). Then a fresh model and optimizer,
with other weights and no AdamW moments, load the checkpoint and train the same 3 steps. Rank 0 writes what the
test compares to the JSON file given: for each rank, its shards right after the save and right after the load, tensor
by tensor (weights, exp_avg, exp_avg_sq); and the reference's and the resumed run's losses.
"""
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402
import modeling  # noqa: E402

checkpoint_root, result_file = Path(sys.argv[1]), Path(sys.argv[2])
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
common.init_process_group(torch.device("cpu"))
# 6 steps x 4 rows x 64
TOKENS = torch.randint(0, common.EOT_ID, (6, 4, 64), generator=torch.Generator().manual_seed(0))


def build(strategy, seed):
    torch.manual_seed(seed)
    model = modeling.build_model("tiny")
    if strategy == "fsdp1":
        wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
        model = FSDP(model, auto_wrap_policy=wrap_policy, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


def train(model, optimizer, steps):
    losses = []
    for step in steps:
        rows = TOKENS[step, rank::world_size]  # each rank its own rows of the step
        targets = torch.cat([rows[:, 1:], torch.full((len(rows), 1), common.IGNORE_INDEX)], 1)
        loss = model(input_ids=rows, targets=targets)
        (loss * world_size / (TOKENS.shape[1] * (TOKENS.shape[2] - 1))).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / (TOKENS.shape[1] * (TOKENS.shape[2] - 1)))
    return losses


def local_state(model, optimizer):
    """This rank's own shards, by name: every weight and, where the optimizer holds them, its AdamW moments."""
    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    tensors = {}
    for name, parameter in model.named_parameters():
        tensors[name] = local(parameter)
        tensors.update({f"{name}.{key}": local(value) for key, value in optimizer.state[parameter].items()
                        if key in ("exp_avg", "exp_avg_sq")})
    return tensors


class AppState(Stateful):
    """The "app" style: model and optimizer as ONE object that DCP asks for its state and hands it back."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def save(style, model, optimizer, folder):
    if style == "app":
        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=folder)
    else:
        dcp.save(get_model_state_dict(model), checkpoint_id=folder / "model")
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=folder / "optimizer")


def load(style, model, optimizer, folder):
    if style == "app":
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=folder)
    else:  # get_optimizer_state_dict gives the fresh AdamW its moments to load into
        model_state, optimizer_state = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
        dcp.load(model_state, checkpoint_id=folder / "model")
        dcp.load(optimizer_state, checkpoint_id=folder / "optimizer")
        set_model_state_dict(model, model_state)
        set_optimizer_state_dict(model, optimizer, optimizer_state)


results = {}
for strategy in ("fsdp1", "fsdp2"):
    for style in ("separate", "app"):
        folder = checkpoint_root / f"{strategy}-{style}"
        model, optimizer = build(strategy, seed=0)
        train(model, optimizer, range(3))
        save(style, model, optimizer, folder)
        saved = local_state(model, optimizer)
        reference_losses = train(model, optimizer, range(3, 6))
        fresh_model, fresh_optimizer = build(strategy, seed=1)  # other weights, and no moments at all
        load(style, fresh_model, fresh_optimizer, folder)
        loaded = local_state(fresh_model, fresh_optimizer)
        resumed_losses = train(fresh_model, fresh_optimizer, range(3, 6))
        differences = [(saved[name] - loaded[name]).abs().max().item()
                       for name in saved if name in loaded and saved[name].numel()]
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, {"saved": sorted(saved), "loaded": sorted(loaded),
                                          "max_difference": max(differences)})
        results[f"{strategy}+{style}"] = {"ranks": per_rank, "reference_losses": reference_losses,
                                          "resumed_losses": resumed_losses}
if rank == 0:
    result_file.write_text(json.dumps(results, indent=1))
dist.barrier()
dist.destroy_process_group()
time.sleep(0.2)  # as the scripts do: gloo's threads free the last collectives' tensors before Python exits
