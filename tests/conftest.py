import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test reaches the network; transformers reads this on import

from helpers import SFT_DATA, TINY_RUN, check, run_script, write_tiny_corpus  # noqa: E402

write_tiny_corpus()  # before any test reads TINY_RUN's --data


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """tiny_run(script): one 2-rank, 20-step run of SCRIPT that saves at steps 10 and 20, made once per session
    and shared by the tests that read it (parity, resume, sharding). Returns (out_dir, CompletedProcess)."""
    runs = {}

    def get(script):
        if script not in runs:
            out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "run"
            # The SFT starts from the FSDP2 pretraining run's newest checkpoint, GRPO from the SFT's.
            source = {"fsdp2_sft.py": "fsdp2_pretrain.py", "fsdp2_grpo.py": "fsdp2_sft.py"}.get(script)
            init = ["--init-from", get(source)[0], "--eval-generate", 8, *SFT_DATA] if source else []
            runs[script] = (out, check(run_script(script, *TINY_RUN, *init, "--out-dir", out, nproc=2)))
        return runs[script]

    return get
