import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # common.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test reaches the network; transformers reads this on import


def pytest_configure(config):
    """The fast tier's marker (pytest_collection_modifyitems), and the tests' prepared data (helpers.DATA_ROOT), before
    any test module reads TINY_RUN's --data: kept in pytest's cache while its sources are the same (`--cache-clear`
    empties it); with the cache off, in a folder removed at the end. Nothing is left in the system's temporary
    directory."""
    config.addinivalue_line("markers", "slow: a test that needs a multi-process run (`pytest -m 'not slow' tests`: "
                            "the others, in under 2 minutes)")
    cache = getattr(config, "cache", None)
    folder = cache.mkdir("prepared-data") if cache else Path(tempfile.mkdtemp(prefix="prepared-data-"))
    if not cache:
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ["LLM_REFERENCE_TEST_DATA"] = str(folder)
    from helpers import prepare_test_data

    prepare_test_data()


@pytest.fixture(scope="session", autouse=True)
def temporary_folders(tmp_path_factory):
    """The tests' own temporary folders (each run's output, the GPU check's dry run) inside pytest's tmp_path, which
    pytest prunes, not in the system's temporary directory."""
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))


# tests/tp_probe.py records the first layer's shards and collectives; tests/pp_probe.py the tied weight's copies;
# tests/cp_probe.py tests the CP attention against one process's. tests/sync_probe.py, before any of them, counts what
# a training step waits on the device for, in every shared run.
PROBES = {"fsdp2_tp_pretrain.py": ("tests/tp_probe.py", "TP_PROBE"),
          "pp_pretrain.py": ("tests/pp_probe.py", "PP_PROBE"),
          "fsdp2_cp_pretrain.py": ("tests/cp_probe.py", "CP_PROBE")}


def pytest_collection_modifyitems(items):
    """A test that reads a shared run (tiny_run, ddp_one_process, parity_of_two_forks: multi-process runs, or shared
    with them) is slow, as is one marked so (it starts multi-process runs of its own). test_gpu_check.py's test runs
    last: it waits for the GPU check's dry run, which starts in the background (pytest_runtest_setup)."""
    for item in items:
        if {"tiny_run", "ddp_one_process", "parity_of_two_forks"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.name == "test_gpu_check.py")


def pytest_runtest_setup(item):
    """The GPU check's dry run (about 140 s of one process) starts beside the first test from test_export_hf.py
    on: from there a core is idle about a quarter of the time (exports, evaluations and the pipeline's stages run one
    process each), where the 2-rank runs before keep both busy."""
    dry_run_test = next((test for test in item.session.items if test.path.name == "test_gpu_check.py"), None)
    if dry_run_test is not None and item.path.name >= "test_export_hf.py" and not dry_run_test.module.DRY_RUN:
        dry_run_test.module.start_dry_run()


@pytest.fixture(scope="session")
def ddp_one_process(tiny_run):
    """DDP on one process with --grad-accum 2, the tiny run's samples: what tensor parallelism (dp 1) and pipeline
    parallelism (one pipeline) must equal. Returns its out_dir."""
    return tiny_run("ddp_pretrain.py", "--grad-accum", 2, nproc=1)[0]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """tiny_run(script, *flags, nproc=2): one 20-step run of SCRIPT that saves at steps 10 and 20, FLAGS after the
    shared ones, made once per session and shared by the tests that read it (parity, resume, sharding). Returns
    (out_dir, CompletedProcess)."""
    from helpers import EXTRA_FLAGS, RL_DATA, SFT_DATA, TINY_RUN, check, run_script

    runs = {}

    def get(script, *flags, nproc=2):
        key = (script, *map(str, flags), nproc)
        if key not in runs:
            out = tmp_path_factory.mktemp(script.removesuffix(".py")) / "run"
            # The SFT starts from the FSDP2 pretraining run's newest checkpoint, GRPO from the SFT's.
            source = {"fsdp2_sft.py": "fsdp2_pretrain.py", "fsdp2_grpo.py": "fsdp2_sft.py"}.get(script)
            script_data = {"fsdp2_sft.py": SFT_DATA, "fsdp2_grpo.py": RL_DATA}.get(script, [])
            init = ["--init-from", get(source)[0], "--eval-generate", 8, *script_data] if source else []
            all_flags = [*TINY_RUN, *EXTRA_FLAGS.get(script, []), *init, *flags, "--out-dir", out]
            # Through probes that record what they see inside the run, into sync.json (and, for the shared run of
            # 2 ranks, probe.json).
            probe, variable = PROBES.get(script, (None, None)) if key == (script, 2) else (None, None)
            env = {"SYNC_PROBE": str(out.parent / "sync.json"), **({variable: str(out.parent / "probe.json")}
                                                                    if probe else {})}
            result = run_script("tests/sync_probe.py", *([probe] if probe else []), script, *all_flags, nproc=nproc,
                                env=env)
            runs[key] = (out, check(result))
        return runs[key]

    return get
