"""The data every script reads: a folder prepared by prepare_data.py (the token ids of every document one after
another, in one uint16 file), memory-mapped. Samples, the validation split and each epoch's length-bucketed schedule
are flat numpy arrays over it, never a Python object per sample; collate copies a batch's rows out of the map."""
import hashlib
import json
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import common
import prepare_data

# ----------------------------------------------------------------------------------------------
# Prepared folders: --data itself, or prepared from it into --cache-dir once per machine.


def prepared_folder(args, tokenizer, kind):
    """The prepared folder of --data: the folder itself if prepare_data.py wrote it, else one in --cache-dir named by
    the source, prepared once per machine by local rank 0 while the other ranks wait for it to appear (polling, not
    a collective, which could time out during a long preparation; if rank 0 fails, torchrun stops them)."""
    data = Path(args.data).expanduser()
    if (data / "tokens.bin").is_file():  # written by prepare_data.py (complete or not: open_prepared tells)
        return data
    source = prepare_data.source_identity(args, kind)  # checks local paths: a bad one fails here, on every rank
    identity = json.dumps([prepare_data.tokenizer_identity(tokenizer), source], sort_keys=True)
    folder = Path(args.cache_dir) / f"{kind}-{tokenizer.name}-{hashlib.sha256(identity.encode()).hexdigest()[:24]}"
    if not (folder / "meta.json").is_file():
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            prepare_data.prepare(args, kind, folder, workers=prepare_data.available_cores())
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
        raise common.UsageError(f"--data {folder} is not a complete prepared folder (no readable meta.json: its "
                                f"preparation was interrupted?): run prepare_data.py again into a new "
                                f"--out-dir") from None
    if format_found != (prepare_data.PREPARED_FORMAT, prepare_data.PREPARED_VERSION):
        raise common.UsageError(f"--data {folder} was prepared in format {format_found}, these scripts read "
                                f"{(prepare_data.PREPARED_FORMAT, prepare_data.PREPARED_VERSION)}: prepare it again "
                                f"with this prepare_data.py")
    if meta["tokenizer"] != prepare_data.tokenizer_identity(tokenizer):
        raise common.UsageError(f"--data {folder} was tokenized with another tokenizer "
                                f"({meta['tokenizer'].get('name')}, other BPE files or markers): prepare it again with "
                                f"this prepare_data.py")
    kind = "pretrain" if kind == "pretrain" else "sft"  # RL problems are stored as conversations
    if meta["kind"] != kind:
        raise common.UsageError(f"--data {folder} holds {meta['kind']} data, this script trains on {kind} data: "
                                f"prepare_data.py{' --sft' if kind == 'sft' else ''} writes that kind")
    for name, file in meta["files"].items():
        if not (Path(folder) / name).is_file() or (Path(folder) / name).stat().st_size != file["bytes"]:
            raise common.UsageError(f"--data {folder} is damaged: {name} is not the {file['bytes']} bytes written: "
                                    f"prepare it again")
    tokens = np.memmap(Path(folder) / "tokens.bin", dtype=np.uint16, mode="r")
    mask = np.memmap(Path(folder) / "loss_mask.bin", dtype=np.uint8, mode="r") if kind == "sft" else None
    return Corpus(tokens, np.load(Path(folder) / "doc_offsets.npy", mmap_mode="r"), mask, meta["content_sha256"])


# ----------------------------------------------------------------------------------------------
# Samples and the validation split.

def validation_documents(n_documents, val_fraction, seed=0):
    """A fixed held-out set of documents, the same whatever the training seed: at most 500 of them. Whole
    documents, so that no chunk of a held-out document is ever trained on."""
    if n_documents < 2:
        raise common.UsageError("the data holds fewer than 2 documents: one is needed for training and one for "
                                "validation; use more --data")
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
    chunk = np.arange(len(document)) - np.repeat(np.cumsum(chunks) - chunks, chunks)  # its number in the document
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


def load_sft_data(args, tokenizer, kind="sft"):
    """Train and validation Splits of encoded conversations, each cut to the largest bucket (its first tokens still
    teach); conversations with no target within that length are left out. kind "rl": 'builtin' is the RL set."""
    corpus = open_prepared(prepared_folder(args, tokenizer, kind), tokenizer, kind)
    starts, lengths = np.asarray(corpus.offsets[:-1]), np.diff(corpus.offsets)
    cut = np.minimum(lengths, args.buckets[-1])
    # Targets per conversation: its mask's sum, less its first token's (a first token is never predicted).
    target_counts = np.add.reduceat(corpus.mask, starts, dtype=np.int64) - corpus.mask[starts]
    for i in np.flatnonzero(lengths > cut):  # the few conversations that are cut: count again within the cut
        target_counts[i] = int(corpus.mask[starts[i] + 1:starts[i] + cut[i]].sum())
    is_val = np.zeros(len(starts), dtype=bool)
    is_val[validation_documents(len(starts), args.val_fraction)] = True

    def split(keep):
        return Split(corpus.tokens, corpus.mask, starts[keep], cut[keep], target_counts[keep], corpus.content_sha256)

    return split(~is_val & (target_counts > 0)), split(is_val & (target_counts > 0))


def answer_prompts(tokenizer, split, limit, reward="exact-text"):
    """Up to `limit` (prompt, reference answer) pairs of a split: the prompt is a conversation up to and with
    its last <|assistant|> marker; the answer is the reference reply's, as common.reply_answer reads it with
    `reward` (exact-text: the text between the solution markers). Conversations whose reply has none are left out.
    Also returns a reply-length bound."""
    prompts, answers, longest = [], [], 0
    for i in range(min(limit, len(split.lengths))):
        tokens = sample_tokens(split, i)
        start = len(tokens) - list(tokens[::-1]).index(common.SPECIAL_TOKENS[common.ROLE_MARKERS["assistant"]])
        answer = common.reply_answer(tokenizer, tokens[start:], reward)
        if answer is not None:
            prompts.append(tokens[:start].tolist())
            answers.append(answer)
            longest = max(longest, len(tokens) - start)
    return prompts, answers, longest + 16


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
    return Schedule(np.concatenate(samples), np.concatenate(starts)[steps], np.concatenate(ends)[steps],
                    np.concatenate(bucket_lens)[steps])


def collate(split, sample_ids, bucket_len, batch_size, pad_id=common.EOT_ID):
    """The samples of `split` at `sample_ids`, copied out of the memory map and right-padded to the bucket
    length, and their targets.

    The target at position t is token t+1 where that token carries loss; padding is never a target. Right
    padding under a causal mask never changes the real tokens' outputs, so no attention mask is needed. Rows
    beyond the samples (a bucket's last, short step) are all padding.
    """
    input_ids = torch.full((batch_size, bucket_len), pad_id, dtype=torch.long)
    targets = torch.full((batch_size, bucket_len), common.IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(sample_ids):
        start, n = split.starts[i], split.lengths[i]
        input_ids[row, :n] = torch.from_numpy(sample_tokens(split, i))
        targets[row, :n - 1] = input_ids[row, 1:n]
        if split.mask is not None:  # SFT: only the assistant's tokens are targets
            not_targets = torch.from_numpy(split.mask[start + 1:start + n] == 0)
            targets[row, :n - 1].masked_fill_(not_targets, common.IGNORE_INDEX)
    return input_ids, targets


# ----------------------------------------------------------------------------------------------
# The data order: what the sequence of training samples depends on.

def data_order(args, train, val, world_size, samples_per_step=None, batch_flags=("tokens_per_batch", "grad_accum")):
    """What the order of the training samples depends on (the data, its split, the buckets, the seed and the samples
    per step), for every checkpoint's meta.json: a resume may not change it (checkpoints.check_resume). Checks first
    that every rank gets samples and that the validation split has some. samples_per_step: the samples one optimizer
    step takes, per bucket, and batch_flags the flags that set them (default: batches of samples, tokens per batch //
    bucket length x grad accum x ranks); a script whose steps take something else passes its own."""
    if len(train.lengths) < world_size:
        raise common.UsageError(f"the data gives {len(train.lengths)} training samples, fewer than the {world_size} "
                                f"ranks: use more --data or fewer ranks")
    if not len(val.lengths):
        raise common.UsageError("the validation split is empty: use more --data or a larger --val-fraction")
    if samples_per_step is None:
        samples_per_step = [bucket_batch_size(args.tokens_per_batch, length) * args.grad_accum * world_size
                            for length in args.buckets]
    return {"data_sha256": train.content_sha256, "val_fraction": args.val_fraction, "buckets": args.buckets,
            "seed": args.seed, "world_size": world_size, "bucket_order": getattr(args, "bucket_order", None),
            "samples_per_step": samples_per_step, "batch_flags": {flag: getattr(args, flag) for flag in batch_flags}}
