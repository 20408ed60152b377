"""benchmarks/gpu_check.py --dry-run: the prepared GPU check's whole sequence on the CPU (tiny preset, fp32, gloo, a few
steps, nothing compiled but with torch.compile's eager backend), so that the command a lent GPU runs first cannot rot
between draws. Every part runs and writes its figures: the pretraining parts on data that fills the bucket, the bare
loops (FSDP2 and DDP) and a compile phase, the ratios and goals, the profiles of three parts, the memory estimate,
tests/test_cuda.py collected (and skipped: no CUDA here), and parity.py's single-GPU rows."""
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
    assert [row["part"] for row in rows] == ["A", "B", "B", "E", "P", "P", "P", "A-ddp", "B-ddp", "N", "M", "M"]
    assert all(row["outcome"].startswith("ok") for row in rows), rows
    speed = [row for row in rows if row.get("tokens_per_s")]
    assert len(speed) == 6
    for row in speed:
        assert row["tokens_per_s"] > 0 and row["peak_allocated_gb"] > 0 and row["spread"] >= 0
        assert row["mfu"] is None and row["peak_reserved_gb"] is None  # a CPU: no peak FLOP/s, no CUDA allocator
        assert "spread <= 10%" in row["goal"]
    assert all(row["non_padding"] > 0.9 for row in speed if "compiled too" not in row["configuration"])  # buckets full
    by_part = {row["part"]: row for row in reversed(rows)}  # each part's first row
    assert by_part["A"]["ratio"] == f"A / B = {by_part['A']['tokens_per_s'] / by_part['B']['tokens_per_s']:.2f}"
    assert by_part["A"]["goal"].startswith("within 5% of B: ")
    assert by_part["A-ddp"]["ratio"].startswith("A-ddp / B-ddp = ") and by_part["B"]["ratio"].startswith("B / B-ddp")
    assert by_part["N"]["ratio"] == f"N / A = {by_part['N']['tokens_per_s'] / by_part['A']['tokens_per_s']:.2f}"
    # The bare loop's phase: the optimizer step compiled too (the eager backend).
    assert rows[2]["configuration"] == "the bare loop above, its optimizer compiled too"
    assert rows[2]["ratio"].startswith("/ the row above = ")
    # The memory estimate's plumbing: FSDP2's and the SFT's estimate on the CPU (no GPU: nothing to hold it against).
    assert [row["configuration"].split(":")[0] for row in rows[10:12]] == [
        "estimate_memory.py fsdp2, bucket 128", "estimate_memory.py sft, bucket 256"]
    assert all(row["ratio"] is None and " GB" in row["configuration"] for row in rows[10:12])
    assert rows[3]["outcome"] == "ok: 0 passed, 0 failed, 11 skipped of 11"  # every script's CUDA test, collected
    # parity.py's single-GPU rows, here on the CPU in fp32: each script against DDP on one process.
    assert [row["configuration"].split(":")[0] for row in rows[4:7]] == [
        f"parity.py {script}, world 1, fp32, 6 steps" for script in ("fsdp1_pretrain.py", "fsdp2_pretrain.py",
                                                                     "fsdp2_3d_pretrain.py")]
    assert all(row["goal"] == "within 1e-05: met" for row in rows[4:7]), rows[4:7]
    # The profiles of A, B and A-ddp: three steps after the timed ones, each step's host time (no GPU to be busy).
    assert sorted(results["profiles"]) == ["A", "A-ddp", "B"]
    for profile in results["profiles"].values():
        assert profile["steps"] == [8, 10] and len(profile["step_ms_each"]) == 3 and profile["step_ms"] > 0
        assert profile["gpu_busy"] is None and profile["syncs"] == 0 and profile["time_of"] == "host"
        assert "aten::mm" in [op["name"] for op in profile["top_operators"]]  # the matmuls: most of a CPU's time
    table = (out / "results.md").read_text()
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 2 + len(rows) + 2 + 3
    assert result.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the tables are printed last
    with tarfile.open(out / "logs.tar.gz") as logs:
        names = set(logs.getnames())
    assert {"A.log", "B.log", "A-ddp.log", "B-ddp.log", "N.log", "M_fsdp2.log", "M_sft.log", "E_tests.log",
            "P.log"} <= names
    assert {f"{part}/profile/{name}" for part in ("A", "B", "A-ddp") for name in ("trace.json.gz", "profile.json")} \
        <= names
    shutil.rmtree(folder)  # kept where the test fails, to be read
