"""Every training script on one GPU, as a user runs it: NCCL, bf16 (the scripts' default on CUDA), CUDA memory
statistics, and --compile once. Each runs the tiny preset for 10 steps (tp 1, cp 1, one pipeline stage) and must log a
finite loss that falls (GRPO: finite; its loss weighs each reply by its group-centred reward, so it has no reason to
fall), an MFU and peak allocated and reserved memory on every step. Skipped where CUDA is absent; part E of
benchmarks/gpu_check.py runs it on a lent GPU. The pretraining runs go at once (tiny models share the GPU easily),
then the SFT from the FSDP2 run, then GRPO from the SFT."""
import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B

from helpers import BUILTIN_RL, BUILTIN_SFT, BUILTIN_TEXT, REPO, read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: benchmarks/gpu_check.py runs it")
# pp_pretrain.py hands the loss its scale through the schedule's loss_kwargs, which torch 2.11 (the lent GPU machine's
# image) lacks; requirements.txt pins 2.13.
PIPELINE_SCALES_LOSS = "loss_kwargs" in inspect.signature(Schedule1F1B.step).parameters

TINY_STEPS = ["--model", "tiny", "--max-steps", 10, "--eval-every", 10, "--save-every", 10, "--val-fraction", 0.002]
PRETRAINING = {  # run name: the script and its flags beyond TINY_STEPS and --data
    "ddp_pretrain": ["ddp_pretrain.py"],
    "fsdp1_pretrain": ["fsdp1_pretrain.py"],
    "fsdp2_pretrain": ["fsdp2_pretrain.py"],
    "fsdp2_pretrain_compiled": ["fsdp2_pretrain.py", "--compile"],
    "fsdp2_tp_pretrain": ["fsdp2_tp_pretrain.py", "--tp", 1],
    "fsdp2_cp_pretrain": ["fsdp2_cp_pretrain.py", "--cp", 1],
    "fsdp2_3d_pretrain": ["fsdp2_3d_pretrain.py"],  # every degree 1 on one GPU
    "pp_pretrain": ["pp_pretrain.py", "--pp", 1],
    "fsdp2_muon_pretrain": ["fsdp2_muon_pretrain.py"],  # Muon's owner ranks: one, the whole matrix its own
    "fsdp2_ep_pretrain": ["fsdp2_ep_pretrain.py"],  # tiny-moe (below), ep 1: its all-to-all within one rank
}
PIPELINE_MARK = pytest.mark.skipif(not PIPELINE_SCALES_LOSS,
                                   reason=f"torch {torch.__version__}'s pipeline schedules take no loss_kwargs")
RUNS = [pytest.param(name, marks=PIPELINE_MARK) if name == "pp_pretrain" else name
        for name in [*PRETRAINING, "fsdp2_sft", "fsdp2_grpo"]]


def start(script, *flags, log, env=None):
    """One process on GPU 0 under torchrun, its output into LOG."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", script, *flags]
    with open(log, "w") as output:
        return subprocess.Popen([str(part) for part in command], cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "recompiles", **(env or {})})


@pytest.fixture(scope="module")
def cuda_runs(tmp_path_factory):
    """{run name: (out_dir, exit status, output)} of every run above."""
    root = tmp_path_factory.mktemp("cuda")
    # FSDP2's run through tests/sync_probe.py: what its steps wait on the GPU for (test_host_syncs.py: on a CPU).
    processes = {name: start(*(["tests/sync_probe.py"] if name == "fsdp2_pretrain" else []), *script_flags[:1],
                             *[f"{flag}-moe" if flag == "tiny" and "_ep_" in name else flag for flag in TINY_STEPS],
                             *script_flags[1:], "--data", BUILTIN_TEXT, "--out-dir", root / name,
                             log=root / f"{name}.log", env={"SYNC_PROBE": str(root / "fsdp2_pretrain_sync.json")})
                 for name, script_flags in PRETRAINING.items() if name != "pp_pretrain" or PIPELINE_SCALES_LOSS}
    processes["fsdp2_pretrain"].wait(timeout=300)
    processes["fsdp2_sft"] = start("fsdp2_sft.py", *TINY_STEPS, "--data", BUILTIN_SFT, "--init-from",
                                   root / "fsdp2_pretrain", "--out-dir", root / "fsdp2_sft", log=root / "fsdp2_sft.log")
    processes["fsdp2_sft"].wait(timeout=300)
    processes["fsdp2_grpo"] = start("fsdp2_grpo.py", *TINY_STEPS, "--data", BUILTIN_RL, "--init-from",
                                    root / "fsdp2_sft", "--out-dir", root / "fsdp2_grpo", log=root / "fsdp2_grpo.log")
    return {name: (root / name, process.wait(timeout=300), (root / f"{name}.log").read_text(errors="replace"))
            for name, process in processes.items()}


@pytest.mark.parametrize("name", RUNS)
def test_script_trains_in_bf16_on_one_gpu_with_mfu_and_cuda_memory(cuda_runs, name):
    out_dir, exit_status, output = cuda_runs[name]
    assert exit_status == 0, output[-6000:]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["device"].startswith("cuda") and config["dtype"] == "bfloat16"
    train, _ = read_metrics(out_dir)
    assert sorted(train) == list(range(1, 11))
    losses = [train[step]["loss"] for step in sorted(train)]
    assert all(math.isfinite(loss) for loss in losses), losses
    if name == "fsdp2_grpo":
        assert all(row["reply_tokens"] > 0 for row in train.values())  # its replies were generated on the GPU
    else:
        assert losses[-1] < losses[0], losses
    for row in train.values():
        assert row["mfu"] is not None and 0 < row["mfu"] < 1  # the GPU is in metrics.PEAK_BF16_FLOPS
        assert 0 < row["peak_mem_gb"] <= row["peak_reserved_gb"]  # the CUDA allocator's, not a process's RSS
    if name == "fsdp2_pretrain_compiled":
        assert "recompile_limit" not in output  # no graph fell back to eager
        compiled, eager = read_metrics(out_dir)[0], read_metrics(out_dir.parent / "fsdp2_pretrain")[0]
        # Step 1: the same weights and batch, so the same loss up to bf16 kernels' rounding.
        assert compiled[1]["loss"] == pytest.approx(eager[1]["loss"], rel=1e-2)


def test_a_training_step_waits_for_the_gpu_once_and_once_more_for_the_losss_targets(cuda_runs):
    """torch.cuda.set_sync_debug_mode's warnings in FSDP2's steps 3 to 5, by where they come from: the loss and the
    gradient norm read together, and the chunked loss's target positions (one micro-batch a step)."""
    out_dir, exit_status, output = cuda_runs["fsdp2_pretrain"]
    assert exit_status == 0, output[-6000:]
    steps = json.loads((out_dir.parent / "fsdp2_pretrain_sync.json").read_text())
    assert [sum(step.values()) for step in steps] == [2, 2, 2], steps
