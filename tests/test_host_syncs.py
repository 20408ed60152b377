"""What a training step waits on the device for, counted by tests/sync_probe.py in the suite's shared runs (rank 0,
steps 3 to 5, outside torch.no_grad): the loss and the gradient norm read together, once, and the loss's target
positions once per micro-batch (their count sets the loss's shapes: logits only at targets). Nothing else: no log line,
peak memory or progress bar waits, so on a GPU the host queues the rest of the step, and the next, ahead of the device.
GRPO reads its rollouts' totals (rewards, reply tokens) once more, before it trains on them."""
import json

import pytest

from helpers import read_metrics

# Per step on rank 0 of each shared run: tp, cp and pp take 2 micro-batches (helpers.EXTRA_FLAGS), the others 1 (GRPO:
# its 8 replies in rows of 4); pp's rank 0 is the first stage, which computes no loss.
EXPECTED = {"ddp_pretrain.py": {"tolist": 1, "nonzero": 1}, "fsdp1_pretrain.py": {"tolist": 1, "nonzero": 1},
            "fsdp2_pretrain.py": {"tolist": 1, "nonzero": 1}, "fsdp2_tp_pretrain.py": {"tolist": 1, "nonzero": 2},
            "fsdp2_cp_pretrain.py": {"tolist": 1, "nonzero": 2}, "pp_pretrain.py": {"tolist": 1},
            "fsdp2_muon_pretrain.py": {"tolist": 1, "nonzero": 1}, "fsdp2_sft.py": {"tolist": 1, "nonzero": 1},
            "fsdp2_grpo.py": {"tolist": 2, "nonzero": 2}}


@pytest.mark.parametrize("script", EXPECTED)
def test_a_training_step_reads_the_device_once_and_the_loss_waits_once_per_micro_batch(script, tiny_run):
    out, _ = tiny_run(script)
    steps = json.loads((out.parent / "sync.json").read_text())
    train, _ = read_metrics(out)
    assert len(steps) == 3
    for step, counted in zip(range(3, 6), steps):
        new_bucket = train[step]["bucket_len"] not in {train[before]["bucket_len"] for before in range(1, step)}
        if script == "pp_pretrain.py" and new_bucket:  # a bucket's first step builds its stage, whose shape inference
            assert counted["tolist"] == 1, (step, counted)  # reads tensors of its own: once a bucket, not a step
        else:
            assert counted == EXPECTED[script], (step, counted)
