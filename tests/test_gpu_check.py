"""benchmarks/gpu_check.py --dry-run: the prepared GPU check's sequence on the CPU (tiny preset, fp32, gloo, a few
steps, nothing compiled), so that the command a lent GPU runs first cannot rot between draws. Each function of the
check runs once and writes its figures: A and the bare loops (FSDP2 and DDP) on data that fills the bucket, the sweep
(its checkpointing chosen by the memory estimates, which run beside it), DDP at the fastest setting, the ratios and
goals, every speed part's profile, tests/test_cuda.py collected (and skipped: no CUDA here), parity.py's single-GPU
rows and the SFT's memory estimate."""
import getpass
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from helpers import PYTHON, REPO, check

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (conftest.py)

DRY_RUN = {}  # its folder and process, once started
# Inductor's own default, which a TMPDIR of the run's own would move: test_compile.py compiles the same layer shapes.
INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))


# The parts the suite runs: each function of the check once (S4x: the sweep's, its estimate for no checkpointing over
# the memory, so selective; A-ep: the same function on another model); S4x-full, S2x, S2x-full, S1x and A-muon are the
# same function with other numbers or another script, shown skipped.
PARTS = "A,B,S4x,A-ddp,B-ddp,A-ep,E,P,M"


def start_dry_run():
    """Start the dry run in the background: conftest.py does, beside the tests that leave a core idle."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-dry-run-"))
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        process = subprocess.Popen([PYTHON, "benchmarks/gpu_check.py", "--dry-run", "--parts", PARTS, "--out",
                                    folder / "out"], cwd=REPO,
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
    assert [row["part"] for row in rows] == ["A", "B", "S4x", "S4x-full", "S2x", "S2x-full", "S1x", "A-ddp", "B-ddp",
                                             "A-muon", "A-ep", "E", "P", "P", "P", "M"]
    skipped = [row for row in rows if row["part"] in ("S4x-full", "S2x", "S2x-full", "S1x", "A-muon")]
    assert all(row["outcome"] == "skipped: not in --parts" for row in skipped)
    rows = [row for row in rows if row not in skipped]
    assert all(row["outcome"].startswith("ok") for row in rows), rows
    speed = [row for row in rows if row.get("tokens_per_s")]
    assert [row["part"] for row in speed] == ["A", "B", "S4x", "A-ddp", "B-ddp", "A-ep"]
    for row in speed:
        assert row["tokens_per_s"] > 0 and row["peak_allocated_gb"] > 0 and row["spread"] >= 0
        assert row["mfu"] is None and row["peak_reserved_gb"] is None  # a CPU: no peak FLOP/s, no CUDA allocator
        assert row["gpu_busy"] is None and row["non_padding"] > 0.9  # no GPU to be busy; the data fills the bucket
        assert "spread <= 10%" in row["goal"]
    by_part = {row["part"]: row for row in speed}
    assert by_part["A"]["ratio"] == f"A / B = {by_part['A']['tokens_per_s'] / by_part['B']['tokens_per_s']:.2f}"
    assert by_part["A"]["goal"].startswith("within 5% of B: ")
    # The sweep: 4x A's tokens a micro-batch under the lightest checkpointing its estimate fits in the memory the dry
    # run stands for the GPU's (4x's selective estimate): not none (its estimate is over), so selective.
    estimates, a_tokens = results["estimates_gb"], by_part["A"]["tokens_per_batch"]
    full, none, selective = f"{a_tokens}:full", f"{4 * a_tokens}:none", f"{4 * a_tokens}:selective"
    assert set(estimates) == {full, none, selective}  # only those the parts that run need
    assert estimates[none] > estimates[selective] > 0 and estimates[full] > 0  # at 4x: no recompute holds more
    for part, tokens, checkpointing in (("A", a_tokens, "full"), ("S4x", 4 * a_tokens, "selective")):
        row = by_part[part]
        assert (row["tokens_per_batch"], row["checkpointing"]) == (tokens, checkpointing)
        assert row["estimate_gb"] == estimates[f"{tokens}:{checkpointing}"]
        assert f"{tokens:,} tokens a micro-batch" in row["configuration"]
    assert by_part["S4x"]["ratio"].startswith("S4x / A = ")
    # DDP at the fastest setting of A and the sweep, beside its bare loop there; the fastest FSDP2 row / A-ddp.
    fastest = max((by_part[part] for part in ("A", "S4x")), key=lambda row: row["tokens_per_s"])
    for part in ("A-ddp", "B-ddp"):
        assert (by_part[part]["tokens_per_batch"], by_part[part]["checkpointing"]) == (
            fastest["tokens_per_batch"], fastest["checkpointing"])
    assert by_part["A-ddp"]["ratio"] == (f"A-ddp / B-ddp = "
                                         f"{by_part['A-ddp']['tokens_per_s'] / by_part['B-ddp']['tokens_per_s']:.2f}")
    assert f"{fastest['part']} / A-ddp = " in fastest["ratio"]
    # The Mixture of Experts of A's active size, at A's setting, against A.
    assert by_part["A-ep"]["configuration"].startswith("fsdp2_ep_pretrain.py --model tiny-moe, bucket 128")
    moe_over_dense = by_part["A-ep"]["tokens_per_s"] / by_part["A"]["tokens_per_s"]
    assert by_part["A-ep"]["ratio"] == f"A-ep / A = {moe_over_dense:.2f}"
    # The memory estimate's plumbing: the SFT's on the CPU (no GPU: nothing to hold it against).
    assert rows[-1]["configuration"].startswith("estimate_memory.py sft, bucket 256: estimate ")
    assert rows[-1]["ratio"] is None
    assert rows[6]["outcome"] == "ok: 0 passed, 0 failed, 13 skipped of 13"  # every script's CUDA test, collected
    # parity.py's single-GPU rows, here on the CPU in fp32: each script against DDP on one process.
    assert [row["configuration"].split(":")[0] for row in rows[7:10]] == [
        f"parity.py {script}, world 1, fp32, 6 steps" for script in ("fsdp1_pretrain.py", "fsdp2_pretrain.py",
                                                                     "fsdp2_3d_pretrain.py")]
    assert all(row["goal"] == "within 1e-05: met" for row in rows[7:10]), rows[7:10]
    # Every speed part is profiled: three steps after the timed ones, each step's host time (no GPU to be busy).
    assert sorted(results["profiles"]) == sorted(by_part)
    for profile in results["profiles"].values():
        assert profile["steps"] == [8, 10] and len(profile["step_ms_each"]) == 3 and profile["step_ms"] > 0
        assert profile["gpu_busy"] is None and profile["syncs"] == 0 and profile["time_of"] == "host"
        assert "aten::mm" in [op["name"] for op in profile["top_operators"]]  # the matmuls: most of a CPU's time
    table = (out / "results.md").read_text()
    table_lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(table_lines) == 2 + len(results["parts"]) + 2 + len(by_part)  # the parts' table, the profiles'
    assert result.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the tables are printed last
    with tarfile.open(out / "logs.tar.gz") as logs:
        names = set(logs.getnames())
    assert {"A.log", "B.log", "S4x.log", "A-ddp.log", "B-ddp.log", "A-ep.log", "M_sft.log", "E_tests.log", "P.log",
            f"estimate_{4 * a_tokens}_selective.log"} <= names
    assert {f"{part}/profile/{name}" for part in by_part for name in ("trace.json.gz", "profile.json")} <= names
    shutil.rmtree(folder)  # kept where the test fails, to be read
