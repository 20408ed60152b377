"""Run pp_pretrain.py unchanged and watch its tied embedding and head, as tests/crash.py runs the scripts: a library
hook is added, the script runs as __main__.

    PP_PROBE=probe.json torchrun --nproc_per_node=2 tests/pp_probe.py pp_pretrain.py [flags]

After every optimizer step each rank that holds the tied weight (a pipeline's first and last stage keep a copy each)
hashes its bytes; rank 0 writes to PP_PROBE, per step, {rank: sha256} of the ranks that hold one.
"""
import hashlib
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402

steps = []


def after_step(optimizer, args, kwargs):
    with torch._C.DisableTorchFunction():  # unseen by tests/sync_probe.py, which counts the script's reads
        tied = [p for group in optimizer.param_groups for p in group["params"] if p.shape[0] == common.VOCAB_SIZE]
        digest = hashlib.sha256(tied[0].detach().cpu().numpy().tobytes()).hexdigest() if tied else None
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)  # every rank steps its optimizer every step: a collective is safe here
        steps.append({rank: d for rank, d in enumerate(digests) if d is not None})
        if dist.get_rank() == 0:
            Path(os.environ["PP_PROBE"]).write_text(json.dumps(steps))


register_optimizer_step_post_hook(after_step)
script = str(REPO / sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
