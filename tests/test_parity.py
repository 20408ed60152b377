"""parity.py: a fork that trains as DDP does passes, one that divides its loss by its own rank's target count fails in
one line naming its row and column; the table, parity.json and parity.png say the same."""
import json
import subprocess

import pytest

from helpers import PYTHON, REPO, TINY_DATA


@pytest.fixture(scope="module")
def parity_of_two_forks(tmp_path_factory):
    """parity.py --scripts on an unchanged copy of fsdp2_pretrain.py and on a broken one, world 2, 6 steps:
    (out_dir, CompletedProcess)."""
    folder = tmp_path_factory.mktemp("forks")
    source = (REPO / "fsdp2_pretrain.py").read_text()
    exact = "(micro_loss_sum * world_size / target_tokens).backward()"
    broken = "(micro_loss_sum * world_size / (targets != common.IGNORE_INDEX).sum()).backward()"  # a rank's own count
    assert source.count(exact) == 1
    (folder / "my_fork.py").write_text(source)
    (folder / "broken_fork.py").write_text(source.replace(exact, broken))
    out = folder / "parity"
    result = subprocess.run([PYTHON, REPO / "parity.py", "--scripts", folder / "my_fork.py", folder / "broken_fork.py",
                             "--world", "2", "--steps", "6", "--data", TINY_DATA, "--out-dir", out], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    return out, result


def test_the_exact_fork_passes_and_the_broken_one_fails_in_one_line_naming_its_row(parity_of_two_forks):
    out, result = parity_of_two_forks
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: broken_fork.py at world 2: ")
    assert "max |grad norm - DDP| is" in errors[0] and errors[0].endswith("over --tolerance 1e-05")


def test_the_table_json_and_plot_hold_every_row(parity_of_two_forks):
    out, result = parity_of_two_forks
    report = json.loads((out / "parity.json").read_text())
    rows = {row["row"]: row for row in report["rows"]}
    assert report["tolerance"] == 1e-5 and report["steps"] == 6 and set(rows) == {"my_fork.py", "broken_fork.py"}
    assert rows["my_fork.py"]["max |loss - DDP|"] <= 1e-5 and rows["my_fork.py"]["max |grad norm - DDP|"] <= 1e-5
    assert rows["broken_fork.py"]["max |grad norm - DDP|"] > 1e-3
    assert rows["my_fork.py"]["reference"] == rows["broken_fork.py"]["reference"] == "ddp-2-batches"  # run once
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["row", "world"]
    fork_line = next(line for line in lines if line.startswith("my_fork.py"))
    assert f"{rows['my_fork.py']['max |loss - DDP|']:.2e}" in fork_line
    assert (out / "parity.png").stat().st_size > 10_000
