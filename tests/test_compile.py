"""--compile: the same losses as eager, and exactly one graph per bucket for training and one for evaluation, shared by
all decoder layers (the bound the scripts set as dynamo's recompile limit), on CPU with inductor. The compile lines are
the same in all four scripts; FSDP2 is tested here (about 100 s: inductor compiles on 2 cores)."""
import re

import pytest

from helpers import TINY_DATA, check, read_metrics, run_script

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (conftest.py)

BUCKETS = [64, 128]
# The tests' corpus, short buckets first, so that 6 steps train in both (4, then 2 steps); the validation split (15% of
# the documents) has samples of both.
COMPILE_RUN = ["--model", "tiny", "--data", TINY_DATA, "--buckets", ",".join(map(str, BUCKETS)), "--bucket-order",
               "ascending", "--max-steps", 6, "--eval-every", 6, "--save-every", 6, "--dtype", "fp32",
               "--val-fraction", 0.15]


def test_compiled_fsdp2_run_matches_eager_with_two_graphs_per_bucket(tmp_path):
    check(run_script("fsdp2_pretrain.py", *COMPILE_RUN, "--out-dir", tmp_path / "eager", nproc=2))
    compiled = check(run_script("fsdp2_pretrain.py", *COMPILE_RUN, "--compile", "--out-dir", tmp_path / "compiled",
                                nproc=2, env={"TORCH_LOGS": "recompiles"}))
    eager_train, eager_val = read_metrics(tmp_path / "eager")
    compiled_train, compiled_val = read_metrics(tmp_path / "compiled")
    assert sorted({row["bucket_len"] for row in compiled_train.values()}) == BUCKETS  # every bucket was trained
    for step in range(1, 7):  # inductor fuses and reorders fp32 arithmetic: equal up to rounding
        assert compiled_train[step]["loss"] == pytest.approx(eager_train[step]["loss"], rel=1e-5)
        assert compiled_train[step]["grad_norm"] == pytest.approx(eager_train[step]["grad_norm"], rel=1e-4)
    assert compiled_val[6] == pytest.approx(eager_val[6], rel=1e-5)
    # Rank 0's log: the first graph is a compile, every further one a recompile that names the layers' function.
    recompiles = re.findall(r"\[rank0\].*Recompiling function (\w+)", compiled.stderr)
    assert set(recompiles) == {"forward_with_checkpointing"}  # only the decoder layers are compiled
    assert len(recompiles) == 2 * len(BUCKETS) - 1  # 2 training and 2 evaluation graphs, shared by both layers
    assert "recompile_limit" not in compiled.stderr  # none fell back to eager
