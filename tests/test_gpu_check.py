"""benchmarks/gpu_check.py --dry-run: the prepared GPU check's whole sequence on the CPU (tiny preset, fp32, gloo, a few
steps), so that the command a lent GPU runs first cannot rot between draws. Every part runs and writes its figures:
the pretraining parts on data that fills the bucket, the bare loop and the ratios, the SFT's memory per bucket, and
tests/test_cuda.py collected (and skipped: no CUDA here)."""
import json
import os
import subprocess
import tarfile

from helpers import PYTHON, REPO, check


def test_dry_run_measures_every_part_and_writes_its_table(tmp_path):
    out = tmp_path / "out"
    result = check(subprocess.run([PYTHON, "benchmarks/gpu_check.py", "--dry-run", "--out", out], cwd=REPO,
                                  env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True,
                                  timeout=600))
    results = json.loads((out / "results.json").read_text())
    rows = results["parts"]
    assert [row["part"] for row in rows] == ["A", "A compiled", "B", "C", "D", "D", "E", "A2"]
    assert all(row["outcome"].startswith("ok") for row in rows), rows
    speed = [row for row in rows if row["part"] in ("A", "A compiled", "B", "C", "A2")]
    for row in speed:
        assert row["tokens_per_s"] > 0 and row["peak_allocated_gb"] > 0
        assert row["mfu"] is None and row["peak_reserved_gb"] is None  # a CPU: no peak FLOP/s, no CUDA allocator
        assert row["non_padding"] > 0.9  # the documents fill the bucket (A2's half-length bucket too)
    assert rows[1]["ratio"].startswith("compiled / eager = ")
    assert rows[2]["ratio"].startswith("A / B = ") and rows[3]["ratio"].startswith("C / A = ")
    assert ["bucket 128" in rows[4]["configuration"], "bucket 256" in rows[5]["configuration"]] == [True, True]
    assert rows[4]["peak_allocated_gb"] > 0 and rows[5]["peak_allocated_gb"] > 0
    assert rows[6]["outcome"] == "ok: 0 passed, 0 failed, 9 skipped of 9"  # every script's CUDA test, collected
    table = (out / "results.md").read_text()
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 2 + len(rows)  # header, a row each
    assert result.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table is printed last
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert {"A_eager.log", "A_compiled.log", "B_bare.log", "C_selective.log", "D_sft.log", "E_tests.log",
                "A2.log"} <= set(logs.getnames())
