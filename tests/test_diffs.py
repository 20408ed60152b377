"""The scripts stay diffable: each `diff` between neighbouring scripts is within its budget of changed lines."""
import subprocess

import pytest

from helpers import REPO

BUDGETS = [("ddp_pretrain.py", "fsdp1_pretrain.py", 80), ("fsdp1_pretrain.py", "fsdp2_pretrain.py", 80),
           ("fsdp2_pretrain.py", "fsdp2_tp_pretrain.py", 100), ("ddp_pretrain.py", "pp_pretrain.py", 150),
           ("fsdp2_pretrain.py", "fsdp2_sft.py", 120), ("fsdp2_sft.py", "fsdp2_grpo.py", 150)]


@pytest.mark.parametrize("before,after,budget", BUDGETS)
def test_diff_between_scripts_is_within_budget(before, after, budget):
    diff = subprocess.run(["diff", before, after], cwd=REPO, capture_output=True, text=True).stdout
    changed = sum(line.startswith(("<", ">")) for line in diff.splitlines())
    print(f"diff {before} {after}: {changed} changed lines")
    assert 0 < changed <= budget
