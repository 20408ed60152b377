"""Run fsdp2_cp_pretrain.py unchanged and test its attention inside the run, as tests/tp_probe.py does: the library
call is patched, the script runs as __main__.

    CP_PROBE=probe.json torchrun --nproc_per_node=2 tests/cp_probe.py fsdp2_cp_pretrain.py [flags]

When the script registers its attention function with transformers, each rank calls it on its zigzag piece of random
queries, keys and values (a generator of its own, the same on every rank), with the first decoder layer's attention
module, and backpropagates a random output gradient; one process's plain causal SDPA over the whole sequence is the
reference. Rank 0 writes to CP_PROBE, for every cp rank, the positions it holds and its largest differences from the
reference's piece (the output, the gradients of the queries, keys and values). No parameter is touched, so the run
trains as if never probed.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

REPO = Path(__file__).resolve().parent.parent
real_register = transformers.AttentionInterface.register.__func__


def probe(attention):
    script = attention.__globals__  # the script's own namespace: it runs as __main__
    cp_rank, zigzag_split = script["cp_rank"], script["zigzag_split"]
    module = script["model"].model.layers[0].self_attn
    heads, kv_heads = module.config.num_attention_heads, module.config.num_key_value_heads
    length, head_dim, scaling = 8 * 2 * script["args"].cp, module.head_dim, module.scaling
    generator = torch.Generator().manual_seed(0)
    query, grad_output = (torch.randn(2, heads, length, head_dim, generator=generator) for _ in range(2))
    key, value = (torch.randn(2, kv_heads, length, head_dim, generator=generator) for _ in range(2))

    whole = [t.clone().requires_grad_() for t in (query, key, value)]  # the reference: one process, plain SDPA
    groups = heads // kv_heads
    output = torch.nn.functional.scaled_dot_product_attention(
        whole[0], whole[1].repeat_interleave(groups, 1), whole[2].repeat_interleave(groups, 1), is_causal=True,
        scale=scaling)
    output.backward(grad_output)

    def piece(tensor):  # this rank's zigzag piece along the sequence (dim 2)
        return zigzag_split(tensor.movedim(2, -1), cp_rank).movedim(-1, 2)

    positions = zigzag_split(torch.arange(length), cp_rank)
    mine = [piece(t).clone().requires_grad_() for t in (query, key, value)]
    cp_output, weights = attention(module, *mine, None, dropout=0.0, scaling=scaling, position_ids=positions[None])
    cp_output.backward(piece(grad_output).transpose(1, 2))  # the interface returns [batch, positions, heads, dim]

    differences = {"output": (cp_output.transpose(1, 2) - piece(output)).abs().max().item()}
    for name, local, reference in zip(("query", "key", "value"), mine, whole):
        differences[f"grad_{name}"] = (local.grad - piece(reference.grad)).abs().max().item()
    report = {"positions": positions.tolist(), "output_shape": list(cp_output.shape), "weights": weights,
              "differences": differences}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        Path(os.environ["CP_PROBE"]).write_text(json.dumps({"sequence": length, "ranks": reports}))


def register(cls, name, function):
    real_register(cls, name, function)
    probe(function)


transformers.AttentionInterface.register = classmethod(register)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
