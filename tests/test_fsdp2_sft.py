"""fsdp2_sft.py end to end on CPU with gloo, and generate.py on the checkpoints of every script."""
import json

import pytest
import torch

import common
import loading
import modeling
import tasks
from helpers import SFT_DATA, TINY_RUN, check, copy_checkpoint, model_tensors, read_metrics, run_script, shown
from prepare_data import encode_conversation

NEW_ROWS = slice(common.EOT_ID + 1, common.EOT_ID + 1 + len(common.SPECIAL_TOKENS))


@pytest.mark.parametrize("script", ["fsdp2_pretrain.py", "fsdp2_muon_pretrain.py"])  # AdamW's, Muon's
def test_init_from_loads_every_pretrained_parameter(script, tiny_run, tmp_path):
    pretrain_dir, _ = tiny_run(script)
    # lr 0: the step-1 checkpoint holds exactly the weights the SFT started from.
    check(run_script("fsdp2_sft.py", "--model", "tiny", "--init-from", pretrain_dir, "--lr", 0, "--max-steps", 1,
                     "--eval-generate", 0, "--val-fraction", 0.002, *SFT_DATA, "--out-dir", tmp_path / "sft", nproc=2))
    pretrained = model_tensors(pretrain_dir / "checkpoints" / "step_20", tmp_path)
    finetuned = model_tensors(tmp_path / "sft" / "checkpoints" / "step_1", tmp_path)
    assert pretrained.keys() == finetuned.keys() and len(pretrained) == 27  # 26 parameters, the tied head twice
    for name, tensor in pretrained.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            rows = torch.ones(tensor.shape[0], dtype=torch.bool)
            rows[NEW_ROWS] = False
            assert torch.equal(finetuned[name][rows], tensor[rows]), name
            # The marker rows start at the mean of the real token rows (plus noise of std 1e-3).
            mean = tensor[:common.EOT_ID + 1].mean(0)
            assert (finetuned[name][NEW_ROWS] - mean).abs().max() < 0.01
            assert not torch.equal(finetuned[name][NEW_ROWS][0], finetuned[name][NEW_ROWS][1])
        else:
            assert torch.equal(finetuned[name], tensor), name


def test_sft_trains_on_assistant_tokens_only_and_resumes_exactly(tiny_run, tmp_path):
    out, _ = tiny_run("fsdp2_sft.py")
    original, val = read_metrics(out)
    assert all(row["target_tokens"] < row["tokens"] for row in original.values())  # prompts carry no loss
    assert sorted(val) == [0, 10, 20] and val[20] < val[0]
    # config.json records the checkpoint the weights came from: --init-from's newest, then the resumed one.
    pretrained = tiny_run("fsdp2_pretrain.py")[0] / "checkpoints" / "step_20"
    assert json.loads((out / "config.json").read_text())["started_from"] == str(pretrained)
    resumed_dir = copy_checkpoint(out, 10, tmp_path)
    check(run_script("fsdp2_sft.py", *TINY_RUN, *SFT_DATA, "--eval-generate", 8, "--out-dir", resumed_dir, "--resume",
                     nproc=2))
    assert json.loads((resumed_dir / "config.json").read_text())["started_from"] == str(resumed_dir / "checkpoints" /
                                                                                          "step_10")
    resumed, _ = read_metrics(resumed_dir)
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        assert resumed[step]["loss"] == pytest.approx(original[step]["loss"], abs=1e-6)


def run_generate(*flags):
    return check(run_script("generate.py", *flags, torchrun=False)).stdout


def test_generate_reads_the_checkpoint_of_every_pretraining_script(tiny_run):
    """The three strategies train the same model, so their step-20 checkpoints continue a text alike: generate.py on
    DDP's, and the same greedy call in this process on FSDP1's and FSDP2's (their DCP formats read by
    load_checkpoint_model)."""
    printed = run_generate(tiny_run("ddp_pretrain.py")[0], "--prompt", "The interpreter", "--max-new-tokens", 12)
    assert printed.startswith("The interpreter")
    tokenizer = common.get_tokenizer()
    for script in ("fsdp1_pretrain.py", "fsdp2_pretrain.py"):
        model, _ = loading.load_checkpoint_model(loading.resolve_checkpoint(tiny_run(script)[0]))
        with torch.no_grad():
            reply = modeling.generate_replies(model, [tokenizer.encode_ordinary("The interpreter")], 12)[0]
        assert "The interpreter" + shown(tokenizer.decode(reply)) + "\n" == printed and len(reply) == 12, script


def test_generate_chat_renders_the_trained_format(tiny_run):
    out, _ = tiny_run("fsdp2_sft.py")
    question = "Compute 4 + 3 - 2 + 1."
    printed = run_generate(out, "--chat", "--prompt", question, "--max-new-tokens", 20)
    # The same reply, made here by hand: system + user turn as in training, then the assistant marker.
    model, meta = loading.load_checkpoint_model(loading.resolve_checkpoint(out))
    tokenizer = common.get_chat_tokenizer()
    prompt, _ = encode_conversation(tokenizer, [("system", tasks.BUILTIN_SYSTEM_PROMPT), ("user", question)])
    with torch.no_grad():
        reply = modeling.generate_replies(model, [prompt + [common.SPECIAL_TOKENS["<|assistant|>"]]], 20)[0]
    stop = [common.SPECIAL_TOKENS[common.END_OF_TURN], common.EOT_ID]
    expected = tokenizer.decode(reply[:-1] if reply and reply[-1] in stop else reply)
    assert printed == shown(expected) + "\n"
