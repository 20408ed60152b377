"""benchmarks/runs.py, what the CPU benchmarks (muon_vs_adamw, lora_vs_sft, moe_vs_dense) run through: a finished run
is read again only while its command, code, data and library versions are the same; a failed run stops the benchmark
with its stderr's end; a diverged (NaN) run is never the best."""
import math
import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import runs  # noqa: E402


def test_a_run_is_reused_until_its_data_or_versions_change_and_a_failure_shows_its_stderr(tmp_path, monkeypatch):
    data, made = tmp_path / "data", tmp_path / "made"
    data.mkdir()
    (data / "tokens.bin").write_bytes(b"one")
    command = [sys.executable, "-c", f"open({str(made)!r}, 'a').write('x')"]  # counts its runs

    def runs_so_far():
        runs.run_once(tmp_path / "run", command, [data])
        return len(made.read_text())

    assert [runs_so_far(), runs_so_far()] == [1, 1]
    (data / "tokens.bin").write_bytes(b"two")  # the data's content, not its name
    assert [runs_so_far(), runs_so_far()] == [2, 2]
    monkeypatch.setattr(runs, "version", lambda name: "another")
    assert [runs_so_far(), runs_so_far()] == [3, 3]
    with pytest.raises(SystemExit, match="(?s)failed \\(1\\).*ValueError: no such rate"):
        runs.run_once(tmp_path / "failed", [sys.executable, "-c", "raise ValueError('no such rate')"], [])
    assert not (tmp_path / "failed" / "run-key.json").exists()  # run again next time
    assert min([3.0, math.nan, 2.0], key=runs.finite) == 2.0
