"""fsdp2_muon_pretrain.py on CPU with gloo: on one process its Muon step is torch.optim.Muon's; at 3 and 4 ranks it
trains as on one process within 1e-5 (3 ranks, every matrix split unevenly: test_parity.py's row against its own world
1); killed at 4 ranks, it resumes on 2 with its momentum resharded, within 1e-5; a fork onto HSDP stops at the step's
assertion; it holds one buffer per matrix where AdamW holds two. Its checkpoints start the SFT (test_fsdp2_sft.py) and
export (test_export_hf.py) as the other FSDP2 scripts' do."""
import shutil

import pytest
import torch

from helpers import REPO, TINY_RUN, assert_same_steps, check, copy_checkpoint, read_metrics, run_script

SCRIPT = "fsdp2_muon_pretrain.py"


def test_the_muon_step_is_torch_optim_muons_on_one_process(tmp_path, monkeypatch):
    """Two steps on one process (the second with momentum), each matrix's update redone by torch.optim.Muon with the
    same coefficients, Nesterov momentum 0.95 and match_rms_adamw's rate: equal within 1e-6. torch's Muon orthogonalizes
    in bf16 whatever its input; the script does in the run's dtype (fp32 here), so torch's runs in fp32 too."""
    probe = tmp_path / "steps.pt"
    check(run_script("tests/muon_probe.py", SCRIPT, *TINY_RUN, "--max-steps", 2, "--out-dir", tmp_path / "run",
                     env={"MUON_PROBE": str(probe)}))
    steps = torch.load(probe, weights_only=True)
    assert len(steps) == 2 and len(steps[0]["before"]) == 14  # 2 layers x q, k, v, o, gate, up, down
    monkeypatch.setattr(torch.Tensor, "bfloat16", torch.Tensor.float)  # torch's Newton-Schulz, in fp32
    matrices = [torch.nn.Parameter(matrix.clone()) for matrix in steps[0]["before"]]
    muon = torch.optim.Muon(matrices, lr=steps[0]["lr"], weight_decay=steps[0]["weight_decay"], momentum=0.95,
                            nesterov=True, adjust_lr_fn="match_rms_adamw")
    for step in steps:
        for matrix, before, grad in zip(matrices, step["before"], step["grads"]):
            assert torch.equal(matrix.data, before)  # where the script's previous step left it
            matrix.grad = grad
        for group in muon.param_groups:
            group["lr"] = step["lr"]  # the warmup's
        muon.step()
        for matrix, after, before in zip(matrices, step["after"], step["before"]):
            assert not torch.equal(after, before)
            torch.testing.assert_close(matrix.data, after, rtol=0, atol=1e-6)
            matrix.data.copy_(after)


@pytest.mark.slow  # a run of its own
def test_a_fork_onto_hsdp_stops_at_the_muon_step_instead_of_updating_wrongly(tmp_path):
    """The step deals each matrix's rows over all ranks, as FSDP2 shards them: a fork that shards the model as HSDP
    (a 2-D mesh, replicated over one rank and sharded over one) stops at its first step, in one assertion; without it,
    the step would run on."""
    source = (REPO / SCRIPT).read_text()
    assert source.count("mp_policy=mixed_precision") == 2  # the layers' and the root's
    mesh = "torch.distributed.device_mesh.init_device_mesh('cpu', (1, 1), mesh_dim_names=('replicate', 'shard'))"
    fork = source.replace("mp_policy=mixed_precision", f"mesh={mesh}, mp_policy=mixed_precision")
    (tmp_path / "muon_on_hsdp.py").write_text(fork)
    result = run_script(tmp_path / "muon_on_hsdp.py", *TINY_RUN, "--max-steps", 1, "--out-dir", tmp_path / "run",
                        env={"PYTHONPATH": str(REPO)})  # our modules, where the fork is not forked by the zygote
    assert result.returncode != 0 and "AssertionError: rows over all ranks (FSDP2's Shard(0))" in result.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The tests' run on one process with 4 micro-batches: the batches of a step on 4 ranks."""
    out = tmp_path_factory.mktemp("muon1") / "run"
    check(run_script(SCRIPT, *TINY_RUN, "--grad-accum", 4, "--out-dir", out))
    return out


@pytest.mark.slow  # multi-process runs of its own
def test_killed_on_4_ranks_it_trains_as_one_process_and_resumes_on_2_with_its_momentum_resharded(one_process, tmp_path):
    """Rank 3 of 4 SIGKILLed before step 12: the 11 steps before equal one process's (1e-5; 3 buckets or more, clipping
    active); step 10's checkpoint resumed on 2 ranks (--grad-accum 2, the same batches) gives its steps 11-20."""
    out = tmp_path / "run"
    result = run_script("tests/crash.py", SCRIPT, *TINY_RUN, "--out-dir", out, nproc=4,
                        env={"CRASH_AT": "step:12", "CRASH_RANK": "3", "CRASH_STAMP": str(tmp_path / "killed_at")})
    assert result.returncode != 0 and (tmp_path / "killed_at").exists()
    reference = assert_same_steps(out, one_process, range(1, 12), 1e-5, 1e-5)
    assert len({reference[step]["bucket_len"] for step in range(1, 12)}) >= 3
    assert any(reference[step]["grad_norm"] > 1.0 for step in range(1, 12))
    resumed = copy_checkpoint(out, 10, tmp_path / "resumed")
    check(run_script(SCRIPT, *TINY_RUN, "--grad-accum", 2, "--out-dir", resumed, "--resume", nproc=2))
    assert sorted(read_metrics(resumed)[0]) == list(range(11, 21))
    assert_same_steps(resumed, one_process, range(11, 21), 1e-5, 1e-5)
    shutil.rmtree(out)


def test_each_rank_holds_one_muon_buffer_per_matrix_shard_where_adamw_holds_two(tiny_run):
    """Its ranks' optimizer state: AdamW's two moments for the embedding, norms and biases, Muon's one buffer for the
    decoder layers' matrices (122,880 elements in the tiny preset), each rank half of each."""
    result = tiny_run(SCRIPT)[1]
    total, matrices = 3_342_912, 122_880
    for rank in (0, 1):
        assert (f"rank {rank} holds {total // 2:,} parameter and {(2 * (total - matrices) + matrices) // 2:,} "
                f"optimizer-state elements") in result.stdout


def test_init_from_takes_an_adamw_checkpoints_weights(tiny_run, tmp_path):
    """--init-from reads only the model: an AdamW run's checkpoint (FSDP2's) starts it; lr 0, so the step-1 checkpoint
    holds exactly the weights it started from."""
    from helpers import model_tensors

    pretrain_dir, _ = tiny_run("fsdp2_pretrain.py")
    check(run_script("fsdp2_muon_pretrain.py", *TINY_RUN, "--init-from", pretrain_dir, "--lr", 0, "--max-steps", 1,
                     "--out-dir", tmp_path / "muon", nproc=2))
    started = model_tensors(pretrain_dir / "checkpoints" / "step_20", tmp_path)
    after = model_tensors(tmp_path / "muon" / "checkpoints" / "step_1", tmp_path)
    assert started.keys() == after.keys() and all(torch.equal(after[name], started[name]) for name in started)
