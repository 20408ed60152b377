"""fsdp2_lora_sft.py on CPU with gloo (tiny, fp32), from the shared FSDP2 pretraining run: the docstring's first
command learns the marker tokens (their rows train: the loss on marker targets falls far below ln V, where frozen rows
keep it); on 4 ranks it trains as one process within 1e-5 at every step, the token rows' gradients in the norm (2
buckets or more, clipping active) and never moves the base (tests/lora_probe.py); killed on 4 ranks, it continues on 2
exactly. Its first step equals PEFT's on the same base, LoraConfig and batch (loss and every trained tensor's gradient,
token rows or the whole embedding). The export loads in PEFT with the script's logits, and PEFT's merge equals the
merged export. On a 4-bit base (--base-dtype nf4) 2 ranks equal one process on the base's dequantized weights, which
the export holds. A moved base is found again by its digest. Bad flags are one line."""
import json
import shutil
import types

import pytest
import torch

import common
import data
import export_hf
import loading
from helpers import BUILTIN_SFT, SFT_DATA, TINY_RUN, assert_same_steps, check, copy_checkpoint, run_script, tree_hashes

SCRIPT = "fsdp2_lora_sft.py"
# 6 steps saved every 3, clipped at every step (the adapters' gradient norm is above 0.2), 128 tokens a micro-batch:
# 4 ranks take a step's samples in one micro-batch each, 2 ranks in 2, one process in 4.
LORA_RUN = [*TINY_RUN, *SFT_DATA, "--max-steps", 6, "--save-every", 3, "--eval-every", 3, "--eval-generate", 0,
            "--grad-clip", 0.02, "--lr", 1e-2, "--lora-rank", 4, "--tokens-per-batch", 128]


@pytest.fixture(scope="module")
def runs(tiny_run, tmp_path_factory):
    """The base; one process; 4 ranks through tests/lora_probe.py, rank 3 killed before its 5th step; its step 3 on 2
    ranks."""
    base, folder = tiny_run("fsdp2_pretrain.py")[0], tmp_path_factory.mktemp("lora")
    found = {"base": base, "probe": folder / "probe.json"}
    for name, nproc in [("one process", 1), ("4 ranks", 4)]:
        found[name] = folder / name.replace(" ", "-")
        env = {"LORA_PROBE": str(found["probe"]), "CRASH_AT": "step:5", "CRASH_RANK": "3"} if nproc == 4 else {}
        wrappers = ["tests/crash.py", "tests/lora_probe.py"] if nproc == 4 else []
        result = run_script(*wrappers, SCRIPT, *LORA_RUN, "--grad-accum", 4 // nproc, "--init-from", base,
                            "--out-dir", found[name], nproc=nproc, env=env)
        assert (result.returncode != 0) == (nproc == 4), result.stderr[-3000:]
    found["2 ranks, resumed"] = copy_checkpoint(found["4 ranks"], 3, folder / "two")
    check(run_script(SCRIPT, *LORA_RUN, "--grad-accum", 2, "--init-from", base, "--out-dir",
                     found["2 ranks, resumed"], "--resume", nproc=2))
    return found


def marker_targets_loss(run):
    """The merged model's mean loss on the validation conversations' marker targets, and how many of them greedy
    decoding picks."""
    model, _ = loading.load_checkpoint_model(loading.resolve_checkpoint(run))
    _, val = data.load_sft_data(types.SimpleNamespace(data=str(BUILTIN_SFT), buckets=[128], val_fraction=0.05))
    split = next(iter(val.values()))
    input_ids, targets = data.collate(split, range(120), 128, 120, torch.device("cpu"))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    is_marker = targets > common.EOT_ID  # (IGNORE_INDEX is negative)
    losses = torch.nn.functional.cross_entropy(logits[is_marker], targets[is_marker], reduction="none")
    return losses.mean().item(), int((logits[is_marker].argmax(-1) == targets[is_marker]).sum()), int(is_marker.sum())


@pytest.mark.slow
def test_the_docstrings_first_command_learns_the_marker_tokens(runs, tmp_path):
    """The tiny preset's defaults, 2 ranks, 20 steps, from a pretraining base that never saw a marker: frozen at the
    real rows' mean, a marker's loss stays at ln V (10.8) and greedy decoding never picks one."""
    check(run_script(SCRIPT, "--model", "tiny", *SFT_DATA, "--eval-generate", 0, "--init-from", runs["base"],
                     "--out-dir", tmp_path / "run", nproc=2))
    loss, picked, count = marker_targets_loss(tmp_path / "run")
    print(f"marker targets: loss {loss:.3f}, greedy picks {picked} of {count}")
    assert count > 500 and loss < 8.0 and picked > 0
    trained = loading.lora_parts(loading.resolve_checkpoint(tmp_path / "run"))[1]
    rows = trained["model.embed_tokens.trainable_tokens_delta"]
    base = loading.load_checkpoint_model(loading.resolve_checkpoint(runs["base"]))[0].model.embed_tokens.weight
    assert rows.shape == (8, base.shape[1]) and (rows - base[:common.EOT_ID + 1].mean(0)).abs().max() > 0.05


@pytest.mark.slow  # multi-process runs of its own
def test_several_ranks_train_as_one_process_and_the_base_never_moves(runs):
    reference = assert_same_steps(runs["4 ranks"], runs["one process"], range(1, 5), 1e-5, 1e-5)
    assert len({reference[step]["bucket_len"] for step in range(1, 7)}) > 1
    assert all(reference[step]["grad_norm"] > 0.02 for step in range(1, 7))  # clipping active at every step
    probe = json.loads(runs["probe"].read_text())
    assert probe["steps"] == 4 and probe["adapted"] == 2 * 7  # every projection of both layers
    assert probe["base_changed"] == [] and probe["adapters_changed"] == 14  # the base bit for bit; every B moved


@pytest.mark.slow
def test_killed_on_4_ranks_it_continues_exactly_on_2(runs):
    assert_same_steps(runs["2 ranks, resumed"], runs["one process"], range(4, 7), 1e-5, 1e-5)
    one, two = (loading.lora_parts(loading.resolve_checkpoint(runs[name]))[1]
                for name in ("one process", "2 ranks, resumed"))
    assert one.keys() == two.keys() and len(one) == 2 * 2 * 7 + 1  # A and B of 7 projections a layer; the token rows
    assert max((one[name] - two[name]).abs().max().item() for name in one) < 1e-5


@pytest.mark.slow
def test_the_peft_folder_gives_the_scripts_logits_and_its_merge_the_merged_export(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = loading.resolve_checkpoint(runs["one process"])
    export_hf.export(checkpoint, tmp_path / "peft")
    export_hf.export(checkpoint, tmp_path / "merged", merge=True)
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 32 and saved["peft_type"] == "LORA"
    assert saved["base_model_name_or_path"] == "base" and saved["trainable_token_indices"] == list(range(50257, 50265))
    input_ids = torch.tensor([common.get_tokenizer().encode_ordinary("The interpreter reads a line")])
    script, _ = loading.load_checkpoint_model(checkpoint)  # W + (alpha / r) B A, as the tools read the run
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base")
    with torch.no_grad():
        base_logits = base(input_ids=input_ids).logits  # (PEFT then adds its layers into this very model)
    peft = PeftModel.from_pretrained(base, tmp_path / "peft")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        expected, merged_logits = script(input_ids=input_ids).logits, merged(input_ids=input_ids).logits
        assert (peft(input_ids=input_ids).logits - expected).abs().max() < 1e-5
        assert (merged_logits - expected).abs().max() < 1e-5
        for folder in ("merged", "peft/base"):  # the tools read each as a plain export
            read, _ = loading.load_checkpoint_model(tmp_path / folder)
            reference = merged_logits if folder == "merged" else base_logits
            assert (read(input_ids=input_ids).logits - reference).abs().max() < 1e-5, folder
        assert (peft.merge_and_unload()(input_ids=input_ids).logits - merged_logits).abs().max() < 1e-5
    check(run_script("evaluate.py", runs["one process"], "--tasks", "arith_gen", "--limit", 2))  # as generate.py reads


@pytest.mark.slow
def test_a_4_bit_base_on_2_ranks_trains_as_one_process_on_its_dequantized_base(runs, tmp_path):
    """The NF4 run equals a plain run from the base's 4-bit round trip (written here as an export), and its export
    holds that dequantized base, on which PEFT gives the tools' logits."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    export_hf.export(loading.resolve_checkpoint(runs["base"]), tmp_path / "dequantized")
    weights_file = tmp_path / "dequantized" / "model.safetensors"
    whole = load_file(weights_file)
    dequantized = {name: to_nf4(w, 64, w.shape[1] // 64).get_original_weight() if name.endswith("proj.weight") else w
                   for name, w in whole.items()}
    assert all(torch.equal(whole[name], w) != name.endswith("proj.weight") for name, w in dequantized.items())
    save_file(dequantized, weights_file, metadata={"format": "pt"})
    short = ["--max-steps", 3, "--save-every", 3]
    for name, nproc, flags in [("nf4", 2, ["--base-dtype", "nf4", "--init-from", runs["base"]]),
                               ("fp32", 1, ["--init-from", tmp_path / "dequantized"])]:
        check(run_script(SCRIPT, *LORA_RUN, *short, "--grad-accum", 4 // nproc, *flags, "--out-dir", tmp_path / name,
                         nproc=nproc))
    assert_same_steps(tmp_path / "nf4", tmp_path / "fp32", range(1, 4), 1e-5, 1e-5)
    checkpoint = loading.resolve_checkpoint(tmp_path / "nf4")
    export_hf.export(checkpoint, tmp_path / "peft")
    assert torch.equal(load_file(tmp_path / "peft" / "base" / "model.safetensors")["model.layers.0.mlp.up_proj.weight"],
                       dequantized["model.layers.0.mlp.up_proj.weight"])
    input_ids = torch.tensor([common.get_tokenizer().encode_ordinary("The interpreter reads a line")])
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base")
    peft = PeftModel.from_pretrained(base, tmp_path / "peft")
    with torch.no_grad():
        logits = loading.load_checkpoint_model(checkpoint)[0](input_ids=input_ids).logits
        assert (peft(input_ids=input_ids).logits - logits).abs().max() < 1e-5


@pytest.mark.parametrize("flags,named", [(["--lora-targets", "q_proj,wq"], "--lora-targets: wq"),
                                         (["--lora-rank", 33], "--lora-rank 33"),
                                         (["--trainable-tokens", "50257,50304"], "at most 50303, got 50304"),
                                         (["--train-embedding", "--trainable-tokens", 50257], "not allowed with"),
                                         (["--base-dtype", "nf4"], "--base-dtype nf4 needs 2 ranks")])
def test_a_bad_adapter_flag_is_one_line(flags, named, tmp_path):
    before = tree_hashes(tmp_path)
    done = run_script(SCRIPT, *TINY_RUN, *SFT_DATA, *flags, "--out-dir", tmp_path / "run")
    assert done.returncode == 2 and named in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert tree_hashes(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("rows", [[], ["--train-embedding"]], ids=["token rows", "whole embedding"])
def test_the_first_step_equals_peft_on_the_same_base_config_and_batch(runs, rows, tmp_path):
    """PEFT itself, from the base's export with the run's LoraConfig (targets, rank, alpha, trainable_token_indices or
    modules_to_save) and the run's initial values copied in, on the run's first batch (one process, fp32, no clipping):
    the same loss, and the same gradient for every lora_A, lora_B and token row (or embedding) within 1e-5."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    first = tmp_path / "first.pt"
    check(run_script("tests/lora_probe.py", SCRIPT, *LORA_RUN, *rows, "--max-steps", 1, "--grad-clip", 0,
                     "--init-from", runs["base"], "--out-dir", tmp_path / "run",
                     env={"LORA_PROBE": str(tmp_path / "probe.json"), "LORA_FIRST_STEP": str(first)}))
    ours = torch.load(first, weights_only=True)
    export_hf.export(loading.resolve_checkpoint(runs["base"]), tmp_path / "base")
    config = json.loads((loading.resolve_checkpoint(tmp_path / "run") / "meta.json").read_text())["config"]
    extra = (dict(modules_to_save=["embed_tokens"], ensure_weight_tying=True) if rows
             else dict(trainable_token_indices=config["trainable_tokens"]))
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), LoraConfig(
        r=config["lora_rank"], lora_alpha=config["lora_alpha"], target_modules=config["lora_targets"], **extra))
    theirs = {name: p for name, p in peft.named_parameters() if p.requires_grad}

    def peft_name(name):  # ours are PEFT's saved names; in the live model each holds its adapter's name, "default"
        name = name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        name = name.replace(".trainable_tokens_delta", ".token_adapter.trainable_tokens_delta.default")
        return "base_model.model." + name.replace("embed_tokens.weight", "embed_tokens.modules_to_save.default.weight")

    assert sorted(map(peft_name, ours["values"])) == sorted(theirs) and len(theirs) == 2 * 2 * 7 + 1
    base_rows = loading.lora_parts(loading.resolve_checkpoint(tmp_path / "run"))[0].model.embed_tokens.weight
    with torch.no_grad():  # our delta adds to the base's rows, PEFT's replaces them
        for name, value in ours["values"].items():
            theirs[peft_name(name)].copy_(value + base_rows[config["trainable_tokens"]] if "delta" in name else value)
    input_ids, targets = ours["batch"]
    logits = peft(input_ids=input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (loss / (targets != common.IGNORE_INDEX).sum()).backward()
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert abs(loss.item() / (targets != common.IGNORE_INDEX).sum().item() - logged["loss"]) < 1e-5
    differences = {name: (theirs[peft_name(name)].grad - grad).abs().max().item()
                   for name, grad in ours["grads"].items()}
    print(f"largest gradient difference: {max(differences.values()):.1e}")
    assert max(differences.values()) < 1e-5, differences
    assert all(grad.abs().max() > 0 for name, grad in ours["grads"].items() if "lora_A" not in name)  # (A: B is 0)
    export_hf.export(loading.resolve_checkpoint(tmp_path / "run"), tmp_path / "peft")  # PEFT's own folder loads it
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "peft" / "base"),
                                       tmp_path / "peft")
    with torch.no_grad():
        expected = loading.load_checkpoint_model(loading.resolve_checkpoint(tmp_path / "run"))[0](input_ids=input_ids)
        assert (loaded(input_ids=input_ids).logits - expected.logits).abs().max() < 1e-5


@pytest.mark.slow
def test_a_moved_base_is_found_again_by_its_digest_and_another_is_one_line(runs, tmp_path):
    """The run records its base's folder as given and the sha256 of its meta.json: moved, the base is one line naming
    --init-from (and --base for the tools), and given its new place, the resume and the export go on."""
    base = tmp_path / "moved-base"
    shutil.copytree(loading.resolve_checkpoint(runs["base"]), base / "checkpoints" / "step_20")
    run = copy_checkpoint(runs["one process"], 3, tmp_path / "run")
    meta_file = run / "checkpoints" / "step_3" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["init_from"] = str(tmp_path / "gone")  # as if the base had lain there
    meta_file.write_text(json.dumps(meta, indent=2))
    flags = [*LORA_RUN, "--grad-accum", 4, "--max-steps", 4, "--out-dir", run, "--resume"]
    before = tree_hashes(run)
    for extra, named in [([], "--init-from"),  # (runs/fsdp2_pretrain, the default: not there, or not that base)
                         (["--init-from", loading.resolve_checkpoint(runs["base"]).parent / "step_10"],
                          f"were trained on {tmp_path / 'gone'}, moved or gone: pass --init-from where")]:
        done = run_script(SCRIPT, *flags, *extra)
        assert done.returncode == 2 and named in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
        assert tree_hashes(run) == before
    with pytest.raises(common.UsageError, match="pass --base where that base lies now"):
        export_hf.export(run, tmp_path / "refused")
    check(run_script(SCRIPT, *flags, "--init-from", base))
    assert_same_steps(run, runs["one process"], [4], 1e-5, 1e-5)
    export_hf.export(run, tmp_path / "peft", base=base)
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
