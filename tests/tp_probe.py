"""Run fsdp2_tp_pretrain.py unchanged and look inside it as it splits its layers, as tests/crash.py does: the library
call is patched, the script runs as __main__.

    TP_PROBE=probe.json torchrun --nproc_per_node=2 tests/tp_probe.py fsdp2_tp_pretrain.py [flags]

When the script makes its first decoder layer tensor-parallel, rank 0 writes to TP_PROBE the local shape of each of
that layer's parameters and the collectives of one forward and one backward of the layer, counted by CommDebugMode on
a batch of its own (its own generator; the layer's gradients are dropped after), so the run trains as if never probed.
The count is of the layer without activation checkpointing's recompute, which repeats the forward's collectives.
"""
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed.tensor.parallel as tensor_parallel
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

REPO = Path(__file__).resolve().parent.parent
real_parallelize_module = tensor_parallel.parallelize_module
probed = []


def counts(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def probe(layer):
    config = layer.self_attn.config
    hidden = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    position_embeddings = Qwen2RotaryEmbedding(config)(hidden, torch.arange(16)[None].expand(2, -1))
    # Without activation checkpointing here: CommDebugMode's module tracker cannot follow a recompute inside backward.
    # With it (always on in training), backward first recomputes the forward, and its collectives, once more.
    layer.gradient_checkpointing = False
    with CommDebugMode() as forward:
        output = layer(hidden, position_embeddings=position_embeddings)
    with CommDebugMode() as backward:
        output.sum().backward()
    layer.gradient_checkpointing = True
    for parameter in layer.parameters():
        parameter.grad = None
    shapes = {name: list((p.to_local() if isinstance(p, DTensor) else p).shape) for name, p in layer.named_parameters()}
    return {"shapes": shapes, "forward": counts(forward), "backward": counts(backward)}


def parallelize_module(module, *args, **kwargs):
    module = real_parallelize_module(module, *args, **kwargs)
    if not probed:
        probed.append(probe(module))
        if int(os.environ.get("RANK", 0)) == 0:
            Path(os.environ["TP_PROBE"]).write_text(json.dumps(probed[0], indent=2))
    return module


tensor_parallel.parallelize_module = parallelize_module
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path.insert(0, str(REPO))
runpy.run_path(script, run_name="__main__")
