"""fsdp2_3d_pretrain.py on CPU with gloo: HSDP x CP x TP on one mesh trains as DDP does with the same global batch, in
three shapes (and HSDP alone: test_multinode.py); a run killed mid-step resumes exactly in another shape; its
checkpoints continue in fsdp2_pretrain.py and back at other world sizes. Its bad combinations: test_bad_input.py.

The suite's one 8-process run, replicate 2 x cp 2 x tp 2, is the one killed: its 11 steps and its step-10 checkpoint
are what the other runs here start from."""
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

import checkpoints
from helpers import (
    TINY_RUN,
    assert_same_steps,
    check,
    copy_checkpoint,
    read_metrics,
    run_script,
)

THREE_D = ["--dp-replicate", 2, "--cp", 2, "--tp", 2]  # on 8 ranks: dp 2 (replicate 2 x shard 1), each cp 2 x tp 2


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """TINY_RUN on 8 processes, every dimension 2, rank 5 SIGKILLed just before step 12 (tests/crash.py), after the
    checkpoint of step 10. (out_dir, CompletedProcess)"""
    out = tmp_path_factory.mktemp("3d8") / "run"
    result = run_script("tests/crash.py", "fsdp2_3d_pretrain.py", *TINY_RUN, *THREE_D, "--out-dir", out, nproc=8,
                        env={"CRASH_AT": "step:12", "CRASH_RANK": "5", "CRASH_STAMP": str(out.parent / "killed_at")})
    assert (out.parent / "killed_at").exists(), f"no rank was killed\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return out, result


def test_replicate_2_x_cp_2_x_tp_2_on_8_ranks_trains_as_ddp_on_2_ranks(killed, tiny_run):
    """dp 2 (the replicas), so DDP on 2 ranks takes the same global batches: the 11 steps before the kill have its
    losses and gradient norms (clipping active), and its validation losses."""
    out, result = killed
    assert result.returncode != 0
    # Its mesh's views are unflattened from one flat mesh: torch's warning on slicing flattened dimensions out of a
    # root mesh (or any other deprecation) reaches no rank's output.
    assert "deprecat" not in (result.stdout + result.stderr).lower()
    ddp = assert_same_steps(out, tiny_run("ddp_pretrain.py")[0], range(1, 12), 1e-5, 1e-5)
    assert len({ddp[step]["bucket_len"] for step in range(1, 12)}) >= 3  # across buckets
    assert any(ddp[step]["grad_norm"] > 1.0 for step in range(1, 12))  # clipping was active, and agreed too
    three_d_val, ddp_val = read_metrics(out)[1], read_metrics(tiny_run("ddp_pretrain.py")[0])[1]
    assert sorted(three_d_val) == [0, 10] and all(abs(three_d_val[s] - ddp_val[s]) <= 1e-5 for s in three_d_val)


def test_the_killed_run_resumes_exactly_in_another_shape(killed, tiny_run, tmp_path):
    """The kill left step 10 whole; --resume on 4 ranks as cp 2 x tp 2 (dp 1, --grad-accum 2: the same global batch):
    steps 11-20 are DDP's, each step logged once; each rank holds half of a tp rank's share (FSDP2 over the cp pair),
    as on 8 ranks, where the other replica held the same."""
    assert [p.name for p in checkpoints.complete_checkpoints(killed[0] / "checkpoints")] == ["step_10"]
    out = shutil.copytree(killed[0], tmp_path / "run")
    result = check(run_script("fsdp2_3d_pretrain.py", *TINY_RUN, "--cp", 2, "--tp", 2, "--grad-accum", 2,
                              "--out-dir", out, "--resume", nproc=4))
    assert "at step 10" in result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 21))
    ddp = assert_same_steps(out, tiny_run("ddp_pretrain.py")[0], range(11, 21), 1e-5, 1e-5)
    assert len({ddp[step]["bucket_len"] for step in range(11, 21)}) >= 3
    held = 3_281_344 // 2  # a tp rank's share of tiny (test_fsdp2_tp_pretrain.py), halved by FSDP2 over the cp pair
    for rank in range(4):
        assert f"rank {rank} holds {held:,} parameter and {2 * held:,} optimizer-state elements" in result.stdout


def test_checkpoints_continue_in_fsdp2_pretrain_and_back_at_other_world_sizes(killed, tiny_run, tmp_path):
    """Side by side: the 8-rank step 10 in fsdp2_pretrain.py on 1 process (--grad-accum 2), and fsdp2_pretrain.py's
    2-rank step 10 in this script on 4 ranks as shard 2 x cp 2 (FSDP2 over the 4 flattened, dp 2). DCP reshards
    both; steps 11-20 are DDP's."""
    def resume(script, source, name, nproc, *flags):
        out = copy_checkpoint(source, 10, tmp_path / name)
        result = check(run_script(script, *TINY_RUN, *flags, "--out-dir", out, "--resume", nproc=nproc))
        assert "at step 10" in result.stdout and sorted(read_metrics(out)[0]) == list(range(11, 21))
        return out

    runs = [("fsdp2_pretrain.py", killed[0], "fsdp2", 1, "--grad-accum", 2),
            ("fsdp2_3d_pretrain.py", tiny_run("fsdp2_pretrain.py")[0], "3d", 4, "--cp", 2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda run: resume(*run), runs))
    for out in outs:
        assert_same_steps(out, tiny_run("ddp_pretrain.py")[0], range(11, 21), 1e-5, 1e-5)

