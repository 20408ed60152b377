"""pp_pretrain.py on CPU with gloo: two stages train as DDP on one process does, under GPipe and 1F1B alike, across
changing bucket shapes; the tied embedding's two copies stay one weight; its checkpoints resume in fsdp2_pretrain.py
(export_hf.py: test_export_hf.py; a crash and its resume: test_crash.py)."""
import json

import pytest

from helpers import EXTRA_FLAGS, TINY_RUN, assert_same_steps, check, copy_checkpoint, read_metrics, run_script

PP_RUN = [*TINY_RUN, *EXTRA_FLAGS["pp_pretrain.py"]]  # the shared run's flags: 2 stages, 2 micro-batches, 1F1B


def test_two_stages_train_as_ddp_on_one_process_across_bucket_shapes(tiny_run, ddp_one_process):
    out, _ = tiny_run("pp_pretrain.py")
    ddp = assert_same_steps(out, ddp_one_process, range(1, 11), 1e-4, 1e-4)
    assert any(ddp[step]["grad_norm"] > 1.0 for step in range(1, 11))  # clipping, over both stages, active
    train = read_metrics(out)[0]
    assert len({train[step]["bucket_len"] for step in range(1, 11)}) >= 3  # a stage and schedule per shape, each used
    assert read_metrics(out)[1] == pytest.approx(read_metrics(ddp_one_process)[1], abs=1e-4)  # evaluation too


def test_gpipe_and_1f1b_take_the_same_steps(tiny_run, tmp_path):
    check(run_script("pp_pretrain.py", *PP_RUN, "--pp-schedule", "gpipe", "--out-dir", tmp_path, nproc=2))
    assert_same_steps(tmp_path, tiny_run("pp_pretrain.py")[0], range(1, 21), 1e-6, 1e-6)


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
