"""benchmarks/gpu_check.py --dry-run: the prepared GPU check's whole sequence on the CPU (tiny preset, fp32, gloo, a few
steps), so that the command a lent GPU runs first cannot rot between draws. Every part runs and writes its figures:
the pretraining parts on data that fills the bucket, the bare loop and the ratios, the SFT's memory per bucket, and
tests/test_cuda.py collected (and skipped: no CUDA here)."""
import getpass
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from helpers import PYTHON, REPO, check

DRY_RUN = {}  # its folder and process, once started
# Inductor's own default, which a TMPDIR of the run's own would move: test_compile.py compiles the same layer shapes.
INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


def start_dry_run():
    """Start the dry run in the background: conftest.py does, beside the tests that leave a core idle."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-dry-run-"))
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen([PYTHON, "benchmarks/gpu_check.py", "--dry-run", "--out", folder / "out"], cwd=REPO,
                                   env={**os.environ, "TMPDIR": str(folder), "TORCHINDUCTOR_CACHE_DIR": INDUCTOR_CACHE},
                                   stdout=stdout, stderr=stderr, text=True)
    DRY_RUN.update(folder=folder, process=process)


def test_dry_run_measures_every_part_and_writes_its_table():
    if not DRY_RUN:
        start_dry_run()
    folder, out = DRY_RUN["folder"], DRY_RUN["folder"] / "out"
    exit_status = DRY_RUN["process"].wait(timeout=900)
    result = check(subprocess.CompletedProcess([], exit_status, (folder / "stdout").read_text(),
                                               (folder / "stderr").read_text()))
    results = json.loads((out / "results.json").read_text())
    rows = results["parts"]
    assert [row["part"] for row in rows] == ["A", "A compiled", "B", "C", "D", "D", "M", "M", "E", "A2"]
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
    # The memory estimate's plumbing: FSDP2's and the SFT's estimate on the CPU (no GPU: nothing to hold it against).
    assert [row["configuration"].split(":")[0] for row in rows[6:8]] == [
        "estimate_memory.py fsdp2, bucket 128", "estimate_memory.py sft, bucket 128"]
    assert all(row["ratio"] is None and " GB" in row["configuration"] for row in rows[6:8])
    assert rows[8]["outcome"] == "ok: 0 passed, 0 failed, 9 skipped of 9"  # every script's CUDA test, collected
    table = (out / "results.md").read_text()
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 2 + len(rows)  # header, a row each
    assert result.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table is printed last
    with tarfile.open(out / "logs.tar.gz") as logs:
        assert {"A_eager.log", "A_compiled.log", "B_bare.log", "C_selective.log", "D_sft.log", "M_fsdp2.log",
                "E_tests.log", "A2.log"} <= set(logs.getnames())
    shutil.rmtree(folder)  # kept where the test fails, to be read
