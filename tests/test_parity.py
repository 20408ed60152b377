"""Every strategy trains as DDP does: the suite's shared runs compared by parity.py's own code, a row per strategy; and
parity.py itself: a fork that trains as DDP does passes, one that divides its loss by its own rank's target count fails
in one line naming its row and column; the table, parity.json and parity.png say the same; a finished run is reused
only while its code, torch and device are the same; a difference that is not a number, too few buckets or steps only
inside the warmup fail a row."""
import json
import math
import subprocess
from pathlib import Path

import pytest

import common
import parity
from helpers import REPO, TINY_DATA, run_parity

# A shared run (conftest.py's tiny_run: 20 steps, 3 buckets or more): its script, flags after the shared ones, ranks.
DDP, DDP_ONE_PROCESS = ("ddp_pretrain.py", [], 2), ("ddp_pretrain.py", ["--grad-accum", 2], 1)
# row: (the run, the run it must equal at the same global batch). TP, CP and PP's shared runs: 2 ranks that read the
# same samples, --grad-accum 2; the pipelines of pp 2 x dp 2 read different ones.
ROWS = {
    "fsdp1": (("fsdp1_pretrain.py", [], 2), DDP),
    "fsdp2": (("fsdp2_pretrain.py", [], 2), DDP),
    "fsdp2 ZeRO-2": (("fsdp2_pretrain.py", ["--reshard-after-forward", "false"], 2), DDP),
    "tp 2": (("fsdp2_tp_pretrain.py", [], 2), DDP_ONE_PROCESS),
    "cp 2": (("fsdp2_cp_pretrain.py", [], 2), DDP_ONE_PROCESS),
    "pp 2, 1F1B": (("pp_pretrain.py", [], 2), DDP_ONE_PROCESS),
    "pp 2 x dp 2, GPipe": (("pp_pretrain.py", ["--pp", 2, "--pp-schedule", "gpipe", "--grad-accum", 1], 4), DDP),
    # Muon's own training, against itself on one process (parity.py's AGAINST_ITSELF row); on 3 ranks every matrix's
    # rows split unevenly (tiny's 64, 32 and 256: the last shard short), padded for the gather and the scatter.
    "muon 3, its world 1": (("fsdp2_muon_pretrain.py", [], 3), ("fsdp2_muon_pretrain.py", ["--grad-accum", 3], 1)),
}


@pytest.mark.parametrize("row", ROWS)
def test_every_strategy_trains_as_ddp_does(row, tiny_run):
    """Each of the 20 steps in the same bucket as DDP's, its loss and grad norm within parity.py's default tolerance
    (relative above 1), across 3 buckets with clipping active; the validation losses too."""
    (script, flags, nproc), (reference_script, reference_flags, reference_nproc) = ROWS[row]
    run = tiny_run(script, *flags, nproc=nproc)[0]
    reference = tiny_run(reference_script, *reference_flags, nproc=reference_nproc)[0]
    found = parity.compare(run, reference)
    print(found)
    assert found["max |loss - ref|"] <= 1e-5 and found["max |grad norm - ref|"] <= 1e-5, found
    (train, val), (reference_train, reference_val) = parity.read_steps(run), parity.read_steps(reference)
    assert sorted(train) == sorted(reference_train) == list(range(1, 21))
    assert len({step["bucket_len"] for step in train.values()}) >= 3
    assert any(step["grad_norm"] > 1.0 for step in reference_train.values())  # clipping was active, and agreed too
    assert sorted(val) == sorted(reference_val) == [0, 10, 20]
    assert all(parity.difference(val[step], reference_val[step]) <= 1e-5 for step in val)


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
    return folder / "parity", run_parity("--scripts", folder / "my_fork.py", folder / "broken_fork.py", "--world", 2,
                                         "--steps", 6, "--data", TINY_DATA, "--out-dir", folder / "parity")


def test_the_exact_fork_passes_and_the_broken_one_fails_in_one_line_naming_its_row(parity_of_two_forks):
    out, result = parity_of_two_forks
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: broken_fork.py at world 2: ")
    assert "max |grad norm - ref| is" in errors[0] and errors[0].endswith("over --tolerance 1e-05")


def test_the_table_json_and_plot_hold_every_row(parity_of_two_forks):
    out, result = parity_of_two_forks
    report = json.loads((out / "parity.json").read_text())
    rows = {row["row"]: row for row in report["rows"]}
    assert report["tolerance"] == 1e-5 and report["steps"] == 6 and set(rows) == {"my_fork.py", "broken_fork.py"}
    assert rows["my_fork.py"]["max |loss - ref|"] <= 1e-5 and rows["my_fork.py"]["max |grad norm - ref|"] <= 1e-5
    assert rows["broken_fork.py"]["max |grad norm - ref|"] > 1e-3
    assert rows["my_fork.py"]["reference"] == rows["broken_fork.py"]["reference"] == "ddp_pretrain-2-batches-6-steps"
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["row", "world"]
    fork_line = next(line for line in lines if line.startswith("my_fork.py"))
    assert f"{rows['my_fork.py']['max |loss - ref|']:.2e}" in fork_line
    assert (out / "parity.png").stat().st_size > 10_000


def test_an_odd_world_runs_only_the_rows_against_their_own_world_1():
    """DDP's reference runs on 2 processes: an odd --world plans only the rows that list it (Muon's 3), or the scripts
    passed --against-itself; another is one line naming --world."""
    world_3 = parity.parse_args(["--world", "3", "--data", str(TINY_DATA)])
    assert [(row[0], row[4]) for row in parity.planned_rows(world_3)] == [("muon", 3)]
    fork = ["--scripts", str(REPO / "fsdp2_muon_pretrain.py"), "--world", "3", "--data", str(TINY_DATA)]
    against_itself = parity.parse_args([*fork, "--against-itself", "micro-batches"])
    assert [row[4] for row in parity.planned_rows(against_itself)] == [3]
    for argv in (["--world", "5", "--data", str(TINY_DATA)], fork):
        with pytest.raises(common.UsageError, match="^--world .*: every world size must be even .*change --world$"):
            parity.parse_args(argv)


def test_a_run_is_reused_only_while_its_code_data_libraries_and_device_are_the_same(tmp_path, monkeypatch):
    """parity.py's run(), its torchrun stood in for: a finished run is reused while nothing that decides its numbers
    changed, and run again once a module the script imports (beside it, or a shared one), the device or torch's
    version changes; the key holds every shared module a script imports and the data's content."""
    (tmp_path / "fork_helpers.py").write_text("SCALE = 1.0\n")
    (tmp_path / "my_fork.py").write_text("import fork_helpers  # noqa\n" + (REPO / "fsdp2_pretrain.py").read_text())
    launched = []

    def torchrun(command, **kwargs):  # the run's folder, as a finished run leaves it
        launched.append(command)
        Path(command[-1]).mkdir(parents=True, exist_ok=True)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(parity.subprocess, "run", torchrun)
    args = parity.parse_args(["--scripts", str(tmp_path / "my_fork.py"), "--data", str(TINY_DATA)])

    def reused():
        return parity.run(tmp_path / "my_fork.py", [], 2, 6, tmp_path / "run", args)[3]

    assert [reused(), reused()] == [False, True] and len(launched) == 1
    (tmp_path / "fork_helpers.py").write_text("SCALE = 1.0  # changed\n")
    assert [reused(), reused()] == [False, True] and len(launched) == 2
    args.device = "cuda"
    assert [reused(), reused()] == [False, True] and len(launched) == 3
    version = parity.importlib.metadata.version
    monkeypatch.setattr(parity.importlib.metadata, "version", lambda name: version(name) + "+other" * (name == "torch"))
    assert [reused(), reused()] == [False, True] and len(launched) == 4
    key = parity.run_key("fsdp2_pretrain.py", ["--flags"], args)
    assert {f"{REPO / name}.py" for name in ("fsdp2_pretrain", "common", "data", "modeling", "metrics",
                                               "checkpoints")} <= set(key["sources"])
    assert key["data"] == json.loads((TINY_DATA / "meta.json").read_text())["content_sha256"]


def test_a_nan_too_few_buckets_or_steps_inside_the_warmup_fail_a_row(tmp_path):
    for name, losses in (("ddp", [5.0, 4.0, 3.0]), ("run", [5.0, math.nan, 3.0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": step, "loss": loss, "grad_norm": 1.0, "bucket_len": 32 * step}) + "\n"
            for step, loss in enumerate(losses, 1)) + json.dumps({"step": 3, "val_loss": 3.0}) + "\n")
    row = {**parity.compare(tmp_path / "run", tmp_path / "ddp"), "steps": 3}
    assert math.isnan(row["max |loss - ref|"]) and row["max |grad norm - ref|"] == row["max |val loss - ref|"] == 0
    assert parity.failed_checks(row, 2, 1e-5) == ["max |loss - ref| is nan, over --tolerance 1e-05"]
    assert parity.failed_checks({**row, "max |loss - ref|": 0.0}, 2, 1e-5) == []
    assert parity.failed_checks({**row, "max |loss - ref|": 0.0, "ref buckets": 2}, 2, 1e-5) == [
        "3 steps train 2 of the 3 buckets, the warmup 2: raise --steps"]
    assert parity.failed_checks({**row, "max |loss - ref|": 0.0}, 3, 1e-5)[0].endswith("the warmup 3: raise --steps")
