"""export_hf.py: every checkpoint format becomes a Hugging Face folder that transformers loads offline and
that computes, tokenizes and generates exactly as the checkpoint does; the checkpoint is never touched."""
import io
import os
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoints
import common
import export_hf
import loading
import modeling
import tasks
from helpers import REPO, SFT_DATA, check, read_metrics, run_script, shown, tree_hashes
from prepare_data import encode_conversation

SCRIPTS = ["ddp_pretrain.py", "fsdp1_pretrain.py", "fsdp2_pretrain.py", "fsdp2_tp_pretrain.py", "fsdp2_cp_pretrain.py",
           "pp_pretrain.py", "fsdp2_muon_pretrain.py", "fsdp2_sft.py", "fsdp2_grpo.py"]
STRINGS = ["Hello world, it's 2026!", "  two  spaces, tabs\tand\nnewlines\n\n",
           "naïve café Ærøskøbing 東京 🙂",
           "1234567 + 89 = 1234656", "def f(x):\n    return [i ** 2 for i in range(10)]  # code\n",
           "<|begin_of_thought|>\n\nFirst, 6 + 2 = 8<|end_of_thought|>", "<|user|>hi<|end_of_turn|><|assistant|>",
           "<|begin_of_solution|>The answer is 7.<|end_of_solution|><|endoftext|>"]


def export(checkpoint, out_dir):
    return run_script("export_hf.py", checkpoint, out_dir, torchrun=False, env={"HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    """{script: (checkpoint folder, exported folder, checkpoint hashes before the export)}"""
    folders = {}
    for script in SCRIPTS:
        checkpoint_dir = loading.resolve_checkpoint(tiny_run(script)[0])
        before = tree_hashes(checkpoint_dir)
        out_dir = tmp_path_factory.mktemp("hf") / script.removesuffix(".py")
        if script == SCRIPTS[0]:
            check(export(checkpoint_dir, out_dir))  # the command line once; the others in this process, for speed
        else:
            export_hf.export(checkpoint_dir, out_dir)
        folders[script] = (checkpoint_dir, out_dir, before)
    return folders


@pytest.mark.parametrize("script", SCRIPTS)
def test_exported_model_computes_the_same_logits(exported, script):
    checkpoint_dir, out_dir, before = exported[script]
    assert tree_hashes(checkpoint_dir) == before  # the export only read the checkpoint
    assert ({"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"}
            <= {p.name for p in out_dir.iterdir()})
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in out_dir.iterdir()} == {0o666 & ~umask}  # readable as any file written
    trained, _ = loading.load_checkpoint_model(checkpoint_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).eval()
    # Qwen2's layers with o_proj biases of zero (export_hf.py says why)
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    input_ids = torch.randint(0, common.EOT_ID + 1 + len(common.SPECIAL_TOKENS), (3, 40),
                              generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids=input_ids).logits, trained(input_ids=input_ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("script", SCRIPTS)
def test_autotokenizer_on_the_export_gives_the_training_ids(exported, script):
    # what pipelines, vLLM, lm-eval call
    hf_tokenizer = AutoTokenizer.from_pretrained(exported[script][1], local_files_only=True)
    tokenizer = common.get_chat_tokenizer()
    for text in STRINGS:
        assert (hf_tokenizer(text, add_special_tokens=False)["input_ids"]
                == tokenizer.encode(text, allowed_special="all")), text
        assert hf_tokenizer.decode(tokenizer.encode(text, allowed_special="all")) == text
    assert ([hf_tokenizer.convert_tokens_to_ids(marker) for marker in common.SPECIAL_TOKENS]
            == list(common.SPECIAL_TOKENS.values()))


def held_out_question():
    """A built-in problem of the SFT's validation split (the tiny run's --val-fraction), never trained on."""
    records = tasks.builtin_sft_records()
    return records[common.validation_documents(len(records), 0.002)[0]]["conversations"][0]["value"]


def test_pipeline_and_generate_py_on_the_export_answer_as_the_checkpoint_does(exported):
    checkpoint_dir, out_dir, _ = exported["fsdp2_sft.py"]
    question = held_out_question()
    printed = check(run_script("generate.py", out_dir, "--chat", "--prompt", question, "--max-new-tokens", 24)).stdout
    # The checkpoint's greedy reply, made here as generate.py --chat makes it: the same text.
    model, _ = loading.load_checkpoint_model(checkpoint_dir)
    tokenizer = common.get_chat_tokenizer()
    prompt, _ = encode_conversation(tokenizer, [("system", tasks.BUILTIN_SYSTEM_PROMPT), ("user", question)])
    with torch.no_grad():
        reply = modeling.generate_replies(model, [prompt + [common.SPECIAL_TOKENS["<|assistant|>"]]], 24)[0]
    assert printed == shown(tokenizer.decode(reply).removesuffix(common.END_OF_TURN)) + "\n"
    chat = transformers.pipeline("text-generation", model=str(out_dir), device="cpu")
    messages = [{"role": "system", "content": tasks.BUILTIN_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    output = chat(messages, max_new_tokens=24, do_sample=False, skip_special_tokens=False)  # keep the reasoning markers
    reply = output[0]["generated_text"][-1]
    assert reply["role"] == "assistant"
    # generation stopped at the end of the turn alike
    assert printed == shown(reply["content"].removesuffix("<|end_of_turn|>")) + "\n"


def test_generate_py_prints_the_vocabularys_unused_padding_rows_as_nothing(exported, monkeypatch, capsys):
    """A barely trained model can sample ids 50,265-50,303, rows that pad the vocabulary and no token owns: they
    decode to nothing (tiktoken's own decode raises KeyError on them). generate.py runs here, its sampler fixed."""
    tokenizer = common.get_chat_tokenizer()
    hello = tokenizer.encode_ordinary(" Hello")
    monkeypatch.setattr(modeling, "generate_replies", lambda *args, **kwargs: [[50_300, *hello, common.VOCAB_SIZE - 1]])
    monkeypatch.setattr(sys, "argv", ["generate.py", str(exported["fsdp2_pretrain.py"][1]), "--prompt", "Say"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(REPO / "generate.py"), run_name="__main__")
    printed = capsys.readouterr()
    assert exit.value.code == 0 and printed.out == "Say Hello\n"
    assert printed.err == f"loaded {exported['fsdp2_pretrain.py'][1]} (exported from fsdp2_pretrain.py, step 20), " \
                          f"model 'tiny'\n"  # what it loaded, on stderr: stdout holds the text alone


def test_generate_py_says_in_one_line_that_a_reply_is_whitespace_only(exported, monkeypatch, capsys):
    """An undertrained model that answers with line breaks alone gets one note on stderr, not 200 blank lines."""
    newline = common.get_chat_tokenizer().encode_ordinary("\n")
    monkeypatch.setattr(modeling, "generate_replies", lambda *args, **kwargs: [newline * 200])
    monkeypatch.setattr(sys, "argv", ["generate.py", str(exported["fsdp2_pretrain.py"][1]), "--prompt", "Say"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "generate.py"), run_name="__main__")
    printed = capsys.readouterr()
    assert printed.out == "Say\n"
    assert printed.err.splitlines()[1:] == ["note: the model's 200 new tokens are whitespace only: an undertrained "
                                            "model"]


def test_a_generate_py_chat_ends_cleanly_at_the_end_of_input(exported, monkeypatch, capsys):
    """One message, then the end of input (Ctrl-D at a terminal): the chat ends, no traceback, exit status 0."""
    checkpoint_dir = exported["fsdp2_sft.py"][0]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Compute 1 + 2.\n"))
    monkeypatch.setattr(sys, "argv", ["generate.py", str(checkpoint_dir), "--chat", "--max-new-tokens", "4"])
    runpy.run_path(str(REPO / "generate.py"), run_name="__main__")  # returns: it neither raises nor exits non-zero
    printed = capsys.readouterr()
    assert printed.out.startswith("user> assistant> ") and printed.out.endswith("\nuser> \n")
    lines = printed.err.splitlines()  # then a note, where the reply was whitespace only
    assert lines[:2] == [f"loaded {checkpoint_dir} (fsdp2_sft.py, step 20), model 'tiny'",
                         "system message: 'Reason step by step.', the built-in set's (--system to change)"]
    assert all(line.startswith("note: the model's ") and "whitespace only" in line for line in lines[2:])


def test_export_refuses_a_partial_checkpoint_and_a_used_out_dir(exported, tmp_path):
    checkpoint_dir, out_dir, _ = exported["ddp_pretrain.py"]
    partial = tmp_path / "step_30"
    partial.mkdir()
    (partial / "checkpoint.pt").write_bytes(b"cut short")  # a save that never wrote its meta.json
    result = run_script("export_hf.py", partial, tmp_path / "a")  # the command line: one line, no traceback
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr  # bad input: no checkpoint there
    assert result.stderr.startswith("error: ") and "is neither a checkpoint folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with pytest.raises(common.UsageError, match="already exists and is not empty"):
        export_hf.export(checkpoint_dir, out_dir)


@pytest.mark.parametrize("damage,message", [("truncated", "is damaged"), ("overwritten", "cannot be read")])
def test_export_refuses_a_damaged_checkpoint_file(damage, message, exported, tmp_path):
    """A short file is caught by the sizes in meta.json; one of the right size but wrong bytes, by the load."""
    checkpoint_dir = exported["ddp_pretrain.py"][0]
    broken = tmp_path / "step_20"
    broken.mkdir()
    (broken / "meta.json").write_bytes((checkpoint_dir / "meta.json").read_bytes())
    weights = (checkpoint_dir / "checkpoint.pt").read_bytes()
    (broken / "checkpoint.pt").write_bytes(weights[:5000] if damage == "truncated" else bytes(len(weights)))
    with pytest.raises(checkpoints.CheckpointError) as error:  # not bad input: its own kind and exit status
        export_hf.export(broken, tmp_path / "out")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_the_sft_starts_from_an_exported_folder_as_from_its_checkpoint(exported, tmp_path):
    """The same first loss from the exported pretraining weights as from the DCP checkpoint (one process: the
    weights, not the sharding, are what an export could get wrong)."""
    pretrain_dir, pretrain_export, _ = exported["fsdp2_pretrain.py"]

    def first_loss(init):  # the two runs side by side, a process each
        out = tmp_path / init.name
        check(run_script("fsdp2_sft.py", "--model", "tiny", "--init-from", init, "--max-steps", 1, "--eval-generate", 0,
                         "--val-fraction", 0.002, *SFT_DATA, "--out-dir", out))
        return read_metrics(out)[0][1]["loss"]

    with ThreadPoolExecutor(max_workers=2) as pool:
        first_losses = list(pool.map(first_loss, [pretrain_dir, pretrain_export]))
    assert first_losses[0] == pytest.approx(first_losses[1], abs=1e-6)
