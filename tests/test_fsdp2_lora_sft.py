"""fsdp2_lora_sft.py on CPU with gloo (tiny, fp32), from the shared FSDP2 pretraining run: on 4 ranks it trains as one
process within 1e-5 at every step (2 buckets or more, clipping active) and never moves the base
(tests/lora_probe.py); killed on 4 ranks, it continues on 2 exactly. The export loads in PEFT with the script's
logits, and PEFT's merge equals the merged export. On a 4-bit base (--base-dtype nf4) 2 ranks equal one process on
the base's dequantized weights, which the export holds. Bad flags are one line."""
import json

import pytest
import torch

import common
import export_hf
import loading
from helpers import SFT_DATA, TINY_RUN, assert_same_steps, check, copy_checkpoint, run_script, tree_hashes

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
    assert one.keys() == two.keys() and len(one) == 2 * 2 * 7
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
    assert saved["base_model_name_or_path"] == str((tmp_path / "peft" / "base").resolve())
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
                                         (["--base-dtype", "nf4"], "--base-dtype nf4 needs 2 ranks")])
def test_a_bad_adapter_flag_is_one_line(flags, named, tmp_path):
    before = tree_hashes(tmp_path)
    done = run_script(SCRIPT, *TINY_RUN, *SFT_DATA, *flags, "--out-dir", tmp_path / "run")
    assert done.returncode == 2 and named in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert tree_hashes(tmp_path) == before


@pytest.mark.slow
def test_a_resume_on_another_base_is_one_line(runs):
    other = runs["base"] / "checkpoints" / "step_10"  # the run's base is its newest, step_20
    before = tree_hashes(runs["2 ranks, resumed"])
    done = run_script(SCRIPT, *LORA_RUN, "--max-steps", 8, "--init-from", other, "--out-dir", runs["2 ranks, resumed"],
                      "--resume")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert f"were trained on {runs['base'] / 'checkpoints' / 'step_20'}" in done.stderr
    assert tree_hashes(runs["2 ranks, resumed"]) == before
