"""fsdp2_ep_pretrain.py on CPU with gloo (tiny-moe, fp32): on 4 ranks, its experts over ep 2 x 2 dp ranks and over ep 4,
and on 2 ranks at ep 2, it trains as one process that takes each step's batches as one batch (the balance loss is over
each micro-batch of all ranks). Each recorded step routes every token to the same experts as one process does,
exactly (tests/ep_probe.py); its router and expert gradients, and its weights after the update, are one process's
within 1e-5, and so are the loss, the balance loss and the gradient norm at every step (3 buckets, clipping active).
Killed at ep 2, it resumes at ep 4; killed there, on 2 ranks: its experts resharded by DCP. parity.py fails a fork
whose expert gradients are not divided by the world size, in one line. The export loads in plain transformers with
the same logits; evaluate.py reads it."""
import json

import pytest
import torch

import loading
import parity
from helpers import REPO, TINY_DATA, TINY_RUN, check, copy_checkpoint, read_metrics, run_parity, run_script

SCRIPT = "fsdp2_ep_pretrain.py"
# The tests' run with the MoE preset; on 4 ranks, 128 tokens a micro-batch each (one process: 512, as one batch), 12
# steps saving every 3.
EP_RUN = [*("tiny-moe" if flag == "tiny" else flag for flag in TINY_RUN), "--tokens-per-batch", 128,
          "--max-steps", 12, "--save-every", 3, "--eval-every", 6]
REFERENCE_STEPS = [1, 7, 10]  # the steps each run below on several ranks records first


def probed(out, *flags, nproc, steps="1", crash_at=None):
    """A run of SCRIPT through tests/ep_probe.py (and tests/crash.py, killing rank 3 before this process's CRASH_AT-th
    step); returns its out_dir and the probe's files' prefix."""
    probe = out.parent / f"{out.name}-probe"
    env = {"EP_PROBE": str(probe), "EP_PROBE_STEPS": steps}
    wrappers = ["tests/ep_probe.py"]
    if crash_at:
        env.update(CRASH_AT=f"step:{crash_at}", CRASH_RANK="3", CRASH_STAMP=str(out.parent / f"{out.name}-killed"))
        wrappers.insert(0, "tests/crash.py")
    result = run_script(*wrappers, SCRIPT, *EP_RUN, *flags, "--out-dir", out, nproc=nproc, env=env)
    if crash_at:
        assert result.returncode != 0 and (out.parent / f"{out.name}-killed").exists(), result.stderr[-3000:]
    else:
        check(result)
    return out, probe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process (512 tokens a batch), then on 4 ranks: ep 2 killed before step 9; its step 6 resumed at ep 4, killed
    before step 10 (its 5th optimizer step: DCP's, which makes AdamW's state for the load, is the first); that run's
    step 9 resumed on 2 ranks at ep 2 (256 tokens each: the same samples a step) to the end (12). {name: (out_dir,
    probe prefix)}."""
    folder = tmp_path_factory.mktemp("ep")
    found = {"one process": probed(folder / "one", "--tokens-per-batch", 512, nproc=1,
                                   steps=",".join(map(str, REFERENCE_STEPS)))}
    found["ep 2"] = probed(folder / "ep2", "--ep", 2, nproc=4, crash_at=9)
    found["ep 4, resumed"] = probed(copy_checkpoint(folder / "ep2", 6, folder / "ep4"), "--ep", 4, "--resume",
                                    nproc=4, crash_at=5)
    found["ep 2 on 2 ranks, resumed"] = probed(copy_checkpoint(folder / "ep4", 9, folder / "ep2-on-2"), "--ep", 2,
                                               "--tokens-per-batch", 256, "--resume", nproc=2)
    return found


# Each run on several ranks: the steps it trained, (its first) the step its probe recorded, its ranks.
TRAINED = {"ep 2": (range(1, 9), 1, 4), "ep 4, resumed": (range(7, 10), 7, 4),
           "ep 2 on 2 ranks, resumed": (range(10, 13), 10, 2)}


@pytest.mark.slow  # multi-process runs of its own
@pytest.mark.parametrize("name", TRAINED)
def test_every_token_goes_to_the_experts_one_process_sends_it_to(runs, name):
    """The recorded step's top-k choices in every layer, on each rank, are one process's for that rank's rows (rank r
    of N holds samples r, r + N, ... of the step): equal exactly, before any tolerance, as top-k is not continuous; the
    recompute in backward chooses as the forward did."""
    (_, reference_probe), (out, probe) = runs["one process"], runs[name]
    _, step, nproc = TRAINED[name]
    reference = torch.load(f"{reference_probe}.step{step}.rank0", weights_only=True)["choices"]
    ranks = [torch.load(f"{probe}.step1.rank{rank}", weights_only=True)["choices"] for rank in range(nproc)]
    bucket_len = read_metrics(out)[0][step]["bucket_len"]
    layers = len(reference) // 2  # the forward's, then the recompute's in backward (last layer first)
    assert layers == 2 and all(len(choices) == 2 * layers for choices in ranks)
    for layer in range(layers):
        assert torch.equal(reference[layer], reference[-1 - layer])
        rows = [choices[layer].view(-1, bucket_len, 2) for choices in ranks]  # [rows, positions, top-k]
        assert torch.equal(torch.stack(rows, 1).flatten(0, 1), reference[layer].view(-1, bucket_len, 2))
        assert all(torch.equal(choices[layer], choices[-1 - layer]) for choices in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_router_and_expert_gradients_and_updated_weights_are_one_processs(runs, name):
    """The first layer's router weight, gate_up_proj and down_proj (all 8 experts, gathered), their clipped gradients
    and their values after AdamW's step: one process's within 1e-5 on every rank (an expert gradient ep times too
    large, or summed over too few ranks, would be off by far more)."""
    _, step, nproc = TRAINED[name]
    reference = torch.load(f"{runs['one process'][1]}.step{step}.rank0", weights_only=True)
    for rank in range(nproc):
        recorded = torch.load(f"{runs[name][1]}.step1.rank{rank}", weights_only=True)
        for kind in ("grads", "after"):
            for weight, expected in reference[kind].items():
                assert recorded[kind][weight].shape == expected.shape
                torch.testing.assert_close(recorded[kind][weight], expected, rtol=0, atol=1e-5)
        assert recorded["grads"]["gate_up_proj"].abs().max() > 1e-4  # a gradient, not zeros


@pytest.mark.slow
def test_loss_balance_loss_and_gradient_norm_are_one_processs_at_every_step_across_kills_and_ep_changes(runs):
    """Steps 1-8 at ep 2, 7-9 at ep 4 (resumed from ep 2's step 6), 10-12 at ep 2 on 2 ranks: each in one process's
    bucket, its loss, balance loss and gradient norm within 1e-5, every layer's tokens per expert (max / mean) equal; 3
    buckets, clipping active; the all-to-all moved rows at ep 2 and 4, none on one process."""
    reference, _ = read_metrics(runs["one process"][0])
    for name, (steps, _, _) in TRAINED.items():
        found = parity.compare(runs[name][0], runs["one process"][0], steps)
        assert found["max |loss - ref|"] <= 1e-5 and found["max |grad norm - ref|"] <= 1e-5, (name, found)
        train, _ = read_metrics(runs[name][0])
        assert set(steps) <= set(train)  # (a killed run's other ranks may log the step its victim died before)
        for step in steps:
            assert abs(train[step]["aux_loss"] - reference[step]["aux_loss"]) <= 1e-5
            assert train[step]["expert_load/0"] == pytest.approx(reference[step]["expert_load/0"], abs=1e-6)
            assert train[step]["all_to_all_mb"] > 0 and reference[step]["all_to_all_mb"] == 0
    assert len({row["bucket_len"] for row in reference.values()}) == 3
    assert any(row["grad_norm"] > 1.0 for row in reference.values())
    assert all(0.9 < row["aux_loss"] < 2.0 for row in reference.values())  # 1 when balanced; top-k or E off: 2x, 8x


@pytest.mark.slow
def test_parity_fails_a_fork_whose_expert_gradients_are_not_divided_by_the_world_size(tmp_path):
    """The script without set_gradient_divide_factor: FSDP2 divides the experts' gradients by their dp ranks only (1 at
    ep 2 on 2 ranks), so they are ep times too large. parity.py, against the fork's own one process: one line."""
    source = (REPO / SCRIPT).read_text()
    line = "    layer.mlp.experts.set_gradient_divide_factor(world_size)\n"
    assert source.count(line) == 1
    (tmp_path / "undivided.py").write_text(source.replace(line, ""))
    result = run_parity("--scripts", tmp_path / "undivided.py", "--model", "tiny-moe", "--against-itself", "one-batch",
                        "--world", 2, "--steps", 6, "--data", TINY_DATA, "--out-dir", tmp_path / "parity")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: undivided.py at world 2: ") and "max |grad norm - ref| is" in errors[0]
    rows = json.loads((tmp_path / "parity" / "parity.json").read_text())["rows"]
    assert rows[0]["reference"] == "undivided-2-batches-as-one-6-steps" and rows[0]["max |grad norm - ref|"] > 1e-3


@pytest.mark.slow
def test_its_export_loads_in_plain_transformers_with_its_logits_and_evaluate_reads_it(runs, tmp_path):
    """export_hf.py of the last checkpoint (ep 2, 2 ranks): AutoModelForCausalLM (transformers' own Qwen2-MoE, its own
    experts implementation) gives the checkpoint's logits within 1e-5; the tools read the export as the checkpoint:
    evaluate.py scores it, generate.py's sampling continues a prompt."""
    import transformers

    import evaluate
    import export_hf
    import modeling

    checkpoint = loading.resolve_checkpoint(runs["ep 2 on 2 ranks, resumed"][0])
    export_hf.export(checkpoint, tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, meta = loading.load_checkpoint_model(checkpoint)
    assert type(exported).__name__ == "Qwen2MoeForCausalLM" and meta["model"] == "tiny-moe"
    input_ids = torch.randint(0, 50_257, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids).logits, ours(input_ids).logits, rtol=0, atol=1e-5)
    again, _ = loading.load_checkpoint_model(tmp_path / "hf")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))
    rows = evaluate.evaluate(evaluate.get_parser().parse_args([str(tmp_path / "hf"), "--tasks", "arith_choice",
                                                               "--limit", "4"]))
    assert [row["n"] for row in rows] == [4, 4] and all(row["value"] > 0 for row in rows[1:])  # gold_bpb
    assert 1 <= len(modeling.generate_replies(again, [[464, 3290]], max_new_tokens=3)[0]) <= 3  # generate.py's way
