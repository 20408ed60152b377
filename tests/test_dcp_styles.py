"""DCP offers two checkpoint styles, model and optimizer saved separately or one Stateful app state, and both
should work with FSDP1 and with FSDP2. The scripts show two of the four pairs (fsdp1_pretrain.py: app state;
fsdp2_pretrain.py: separate); this proves all four: a fresh model and optimizer load the weights and AdamW
moments exactly, and train on as the uninterrupted run did."""
import json

import pytest

from helpers import REPO, check, run_script

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (conftest.py)

PAIRS = ["fsdp1+separate", "fsdp1+app", "fsdp2+separate", "fsdp2+app"]


@pytest.fixture(scope="module")
def dcp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp_styles")
    check(run_script(REPO / "tests" / "dcp_styles.py", tmp / "checkpoints", tmp / "results.json", nproc=2))
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("pair", PAIRS)
def test_both_dcp_styles_restore_fsdp_weights_and_moments_exactly(pair, dcp_results):
    result = dcp_results[pair]
    # each rank's own shards (FSDP1: a rank holds moments only where its flat shard has elements)
    for rank in result["ranks"]:
        assert rank["loaded"] == rank["saved"] and rank["max_difference"] == 0.0
    names = set().union(*(rank["saved"] for rank in result["ranks"]))
    assert len(names) == 26 + 2 * 26  # tiny's 26 parameters (the tied head is one), exp_avg and exp_avg_sq of each
    assert result["resumed_losses"] == pytest.approx(result["reference_losses"], abs=1e-6)
    # it trained: the check compared moving weights
    assert result["reference_losses"][-1] < result["reference_losses"][0]
