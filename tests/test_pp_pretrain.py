"""pp_pretrain.py on CPU with gloo: two stages train as DDP on one process does, under GPipe and 1F1B alike, across
changing bucket shapes; the tied embedding's two copies stay one weight; its checkpoints resume in fsdp2_pretrain.py
(export_hf.py: test_export_hf.py; a crash and its resume: test_crash.py)."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import EXTRA_FLAGS, TINY_RUN, assert_same_steps, check, copy_checkpoint, read_metrics, run_script

PP_RUN = [*TINY_RUN, *EXTRA_FLAGS["pp_pretrain.py"]]  # the shared run's flags: 2 stages, 2 micro-batches, 1F1B


@pytest.mark.slow  # multi-process runs of its own
def test_under_bf16_gpipe_trains_as_ddp_does_the_head_and_loss_in_bf16_too(tmp_path):
    """--dtype bf16 on CPU: each stage's forward and the last stage's loss run inside autocast, as DDP's forward and
    loss do, so the two take the same bf16 steps (a head and loss left in fp32 made step 0's loss differ by 1.5e-4).
    GPipe here, 1F1B in the shared fp32 run: both schedules are held to DDP."""
    flags = [*PP_RUN, "--dtype", "bf16", "--max-steps", 2, "--eval-every", 2]

    def run(script):  # side by side: one process of DDP, two stages of PP, the same 2 micro-batches a step
        pp = ["--pp-schedule", "gpipe"] if script == "pp_pretrain.py" else []
        return check(run_script(script, *flags, *pp, "--out-dir", tmp_path / script, nproc=2 if pp else 1))

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run, ["ddp_pretrain.py", "pp_pretrain.py"]))
    # The loss at 1e-5 relative (1e-4 at a loss of 10) catches a head left in fp32; grad norms differ by up to 1.5e-4
    # where the CPU has bf16 dot products (AVX512-BF16), whose kernels round by the batch's shape: 1e-3, still far
    # below bf16's 7.8e-3.
    assert_same_steps(tmp_path / "pp_pretrain.py", tmp_path / "ddp_pretrain.py", range(1, 3), 1e-5, 1e-3)
    pp_val, ddp_val = read_metrics(tmp_path / "pp_pretrain.py")[1], read_metrics(tmp_path / "ddp_pretrain.py")[1]
    assert pp_val[0] == pytest.approx(ddp_val[0], abs=1e-6) and pp_val[2] == pytest.approx(ddp_val[2], abs=1e-3)


def test_the_tied_embedding_and_head_stay_one_weight(tiny_run):
    """The first stage's embedding and the last stage's head are two copies of one tensor: after every step their
    bytes are equal (tests/pp_probe.py hashes them), as their summed gradient and the same update keep them."""
    steps = json.loads((tiny_run("pp_pretrain.py")[0].parent / "probe.json").read_text())
    assert len(steps) == 20
    for digests in steps:
        assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"]  # both stages hold a copy, equal


def test_a_pp_checkpoint_resumes_in_fsdp2_pretrain_on_one_process(tiny_run, tmp_path):
    """Keyed by the whole model's names, the two stages' checkpoint is one FSDP2 reads as its own; one process with the
    same 2 micro-batches takes the same global batches."""
    out, _ = tiny_run("pp_pretrain.py")
    resumed = copy_checkpoint(out, 10, tmp_path)
    result = check(run_script("fsdp2_pretrain.py", *PP_RUN, "--out-dir", resumed, "--resume"))
    assert "at step 10" in result.stdout
    assert sorted(read_metrics(resumed)[0]) == list(range(11, 21))
    assert_same_steps(resumed, out, range(11, 21), 1e-4, 1e-4)
