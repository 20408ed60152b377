"""FSDP1 and FSDP2 against DDP on CPU with gloo: same numbers, real sharding, exact and resharded resume."""
import re
import shutil

import pytest

from helpers import TINY_RUN, assert_same_weights_and_moments, check, copy_checkpoint, read_metrics, run_script

FSDP_SCRIPTS = ["fsdp1_pretrain.py", "fsdp2_pretrain.py"]


def held_elements(stdout):
    """{rank: (parameter elements, optimizer-state elements)} from the line every rank prints at the end."""
    found = re.findall(r"rank (\d+) holds ([\d,]+) parameter and ([\d,]+) optimizer-state elements "
                       r"\(([\d,]+) parameters", stdout)

    def number(text):
        return int(text.replace(",", ""))

    return {int(r): (number(p), number(o), number(n)) for r, p, o, n in found}


@pytest.mark.parametrize("script", FSDP_SCRIPTS)
def test_each_fsdp_rank_holds_half_of_the_parameters_and_optimizer_state(script, tiny_run):
    held = held_elements(tiny_run(script)[1].stdout)
    assert sorted(held) == [0, 1]
    n_params = held[0][2]
    assert n_params == 3_342_912  # the tiny preset
    # FSDP1 pads its flat shards
    assert sum(params for params, _, _ in held.values()) == pytest.approx(n_params, abs=64)
    for params, optimizer_state, _ in held.values():
        assert params == pytest.approx(n_params / 2, rel=0.01)
        assert optimizer_state == 2 * params  # AdamW: exp_avg and exp_avg_sq per element held


def test_each_ddp_rank_holds_everything(tiny_run):
    held = held_elements(tiny_run("ddp_pretrain.py")[1].stdout)
    assert sorted(held) == [0, 1]
    assert all(params == n and optimizer_state == 2 * n for params, optimizer_state, n in held.values())


def test_resume_skips_interrupted_saves_and_reproduces_steps_11_to_20_and_the_optimizer_moments(tiny_run, tmp_path):
    """FSDP1 here; FSDP2's resume is checked the same way after a real crash (test_crash.py). The interrupted saves
    are staged by hand (DDP and FSDP2 are really killed mid-save in test_crash.py)."""
    script = "fsdp1_pretrain.py"
    out, _ = tiny_run(script)
    resumed_dir = copy_checkpoint(out, 10, tmp_path / "resumed")
    # A save killed before its commit: the partial folder holds the weights but was never renamed.
    shutil.copytree(out / "checkpoints" / "step_20", resumed_dir / "checkpoints" / ".partial_step_20")
    # A step folder without meta.json (written last, before the rename) is not complete either.
    shutil.copytree(out / "checkpoints" / "step_20", resumed_dir / "checkpoints" / "step_30")
    (resumed_dir / "checkpoints" / "step_30" / "meta.json").unlink()
    result = check(run_script(script, *TINY_RUN, "--out-dir", resumed_dir, "--resume", nproc=2))
    assert "resumed from" in result.stdout and "step_10 at step 10" in result.stdout
    assert "changed against the checkpoint" not in result.stdout  # the same flags: nothing to report
    original, _ = read_metrics(out)
    resumed, _ = read_metrics(resumed_dir)
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed[step]["loss"] == pytest.approx(original[step]["loss"], abs=1e-6)
    # Both runs end with a step-20 checkpoint.
    assert_same_weights_and_moments(resumed_dir / "checkpoints" / "step_20", out / "checkpoints" / "step_20", tmp_path)


def test_checkpoint_from_2_ranks_resumes_on_1_rank(tiny_run, tmp_path):
    """DCP reshards on load: FSDP1 here (FSDP2's, a 4-rank 2D checkpoint resumed on 1 rank: test_fsdp2_tp_pretrain.py).
    With two micro-batches, 1 rank takes the same global batches as 2 ranks did: the same data order (a change of the
    global batch is refused), micro-batch m being what rank m fed."""
    script = "fsdp1_pretrain.py"
    out, _ = tiny_run(script)
    resumed_dir = copy_checkpoint(out, 10, tmp_path)
    result = check(run_script(script, *TINY_RUN, "--grad-accum", 2, "--out-dir", resumed_dir, "--resume", nproc=1))
    assert "at step 10" in result.stdout
    original, _ = read_metrics(out)
    resumed, _ = read_metrics(resumed_dir)
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed[step]["loss"] == pytest.approx(original[step]["loss"], abs=1e-5)
