"""The data every script reads: prepare_data.py's folders, memory-mapped. Samples, validation splits, mixtures and
each epoch's bucketed schedule are numpy arrays over them, never an object per sample; collate copies a batch out."""
import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

import common

PREPARED_FORMAT, PREPARED_VERSION = "llm-reference-tokens", 1


def tokenizer_identity(chat_format):
    """What a prepared folder's ids depend on: the encoding (with the chat markers or not), its files and markers."""
    return {"name": "gpt2-chat" if chat_format else "gpt2", "vocab_bpe_sha256": common.GPT2_VOCAB_BPE_SHA256,
            "encoder_json_sha256": common.GPT2_ENCODER_JSON_SHA256,
            "special_tokens": {"<|endoftext|>": common.EOT_ID, **(common.SPECIAL_TOKENS if chat_format else {})}}


# ----------------------------------------------------------------------------------------------
# Sources: --data FOLDER[:WEIGHT] ..., each a folder written by prepare_data.py.

def source_and_weight(item, flag):
    """(FOLDER, WEIGHT or None) of a FOLDER[:WEIGHT] item; a path may hold a ':', but not after its last '/'."""
    if ":" not in item or "/" in item.rsplit(":", 1)[1]:
        return item, None
    source, text = item.rsplit(":", 1)
    try:
        weight = float(text)
    except ValueError:
        raise common.UsageError(f"{flag} {item}: its weight '{text}' is not a number: pass FOLDER:WEIGHT, e.g. "
                                f"data/builtin:0.7") from None
    if not (weight > 0 and np.isfinite(weight)):
        raise common.UsageError(f"{flag} {item}: a weight is a positive share of the tokens, got {text}")
    return source, weight


def parse_sources(items):
    """[(folder, weight or None)] of --data's FOLDER[:WEIGHT] items. Weights are shares of the training tokens,
    normalized to sum to 1, given for every source or for none (each sample then taken once an epoch)."""
    sources = [source_and_weight(item, "--data") for item in items]
    weights = [weight for _, weight in sources]
    if None in weights and any(weight is not None for weight in weights):
        raise common.UsageError(f"--data {' '.join(items)}: give every source a weight, or none (each sample once an "
                                f"epoch)")
    if len({source for source, _ in sources}) < len(sources):
        raise common.UsageError(f"--data {' '.join(items)} names a source twice: give it once, with one weight")
    return [(source, weight / sum(weights) if weight else None) for source, weight in sources]


def source_names(sources):
    """A short name per source, for its validation loss (val_loss/<name>): its folder's name."""
    names = [Path(source.rstrip("/")).name or source for source in sources]
    return [name if names.count(name) == 1 else f"{name}-{i}" for i, name in enumerate(names)]


class Corpus(NamedTuple):
    """A prepared folder, memory-mapped: document i is tokens[offsets[i]:offsets[i + 1]]."""
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None  # conversations: 1 on the targets (an assistant's tokens); text: None
    chat_format: bool  # conversations in the chat format: a model trained on them knows its markers
    content_sha256: str  # names the data in checkpoints: a resume on other data is refused


def open_prepared(folder, flag, conversations=False):
    """Memory-map a folder of prepare_data.py, once checked whole and of this format and tokenizer; text, or
    conversations (prepare_data.py --sft: with their loss mask; conversations=True: only these)."""
    path = Path(folder).expanduser()
    try:
        meta = json.loads((path / "meta.json").read_text())
        chat_format = meta["kind"] == "sft"
        made_here = [meta["format"], meta["version"], meta["tokenizer"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise common.UsageError(f"{flag} {folder} is no complete folder written by prepare_data.py: prepare it first "
                                f"(`python prepare_data.py` writes the built-in sets into data/, `python "
                                f"prepare_data.py{' --sft' if conversations else ''} --data SOURCE --out-dir FOLDER` "
                                f"any other)") from None
    if made_here != [PREPARED_FORMAT, PREPARED_VERSION, tokenizer_identity(chat_format)]:
        raise common.UsageError(f"{flag} {folder} was prepared in another format or with another tokenizer: prepare it "
                                f"again with this prepare_data.py")
    if conversations and not chat_format:
        raise common.UsageError(f"{flag} {folder} holds text, this script trains on conversations: prepare_data.py "
                                f"--sft writes them")
    for name, file in meta["files"].items():
        if not (path / name).is_file() or (path / name).stat().st_size != file["bytes"]:
            raise common.UsageError(f"{flag} {folder} is damaged: {name} is not the {file['bytes']} bytes written: "
                                    f"prepare it again")
    tokens = np.memmap(path / "tokens.bin", dtype=np.uint16, mode="r")
    mask = np.memmap(path / "loss_mask.bin", dtype=np.uint8, mode="r") if chat_format else None
    return Corpus(tokens, np.load(path / "doc_offsets.npy", mmap_mode="r"), mask, chat_format, meta["content_sha256"])


# ----------------------------------------------------------------------------------------------
# Samples and the validation split.

class Split(NamedTuple):
    """The samples of one split, as flat arrays over the memory-mapped sources."""
    tokens: list  # each source's token ids
    masks: list  # each source's loss mask (1 on an assistant's tokens), or None: every token but a sample's first
    sources: np.ndarray  # sample i is tokens[sources[i]][starts[i]:starts[i] + lengths[i]]
    starts: np.ndarray
    lengths: np.ndarray
    target_counts: np.ndarray  # of sample i's positions, how many carry a loss
    shares: np.ndarray | None  # a mixture's share of an epoch's tokens per source; None: every sample once an epoch
    chat_format: bool  # some of its data is conversations in the chat format
    content_sha256: str


def one_source_split(corpus, mask, starts, lengths, target_counts):
    return Split([corpus.tokens], [mask], np.zeros(len(starts), dtype=np.int64), starts, lengths, target_counts, None,
                 corpus.chat_format, corpus.content_sha256)


def sample_tokens(split, i):
    start = split.starts[i]
    return np.asarray(split.tokens[split.sources[i]][start:start + split.lengths[i]], dtype=np.int64)


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


def load_pretraining_data(args):
    """The training Split of --data's sources (a mixture if weights are given) and each source's validation Split, by
    name. A folder of conversations is read as text in the chat format, every token a target (midtraining)."""
    folders, weights = zip(*parse_sources(args.data))
    train, val = zip(*(text_splits(open_prepared(folder, "--data"), args) for folder in folders))
    shares = None if weights[0] is None else np.array(weights)
    return mixture(train, shares), dict(zip(source_names(folders), val))


def text_splits(corpus, args):
    """Train and validation Splits of a text corpus, every token but a sample's first a target."""
    val_documents = common.validation_documents(len(corpus.offsets) - 1, args.val_fraction)
    train_documents = np.setdiff1d(np.arange(len(corpus.offsets) - 1), val_documents)
    samples = (document_samples(corpus, documents, args.buckets[-1]) for documents in (train_documents, val_documents))
    return [one_source_split(corpus, None, starts, lengths, lengths - 1) for starts, lengths in samples]


def mixture(splits, shares):
    """One Split of several sources' Splits; shares: each one's share of an epoch's tokens (None: every sample once).
    Its content hash names the sources and their shares, so a resume on another mixture is refused."""
    if len(splits) == 1 and shares is None:
        return splits[0]
    named = json.dumps([[split.content_sha256 for split in splits], None if shares is None else shares.tolist()])
    return Split([split.tokens[0] for split in splits], [split.masks[0] for split in splits],
                 np.concatenate([np.full(len(split.starts), i) for i, split in enumerate(splits)]),
                 *(np.concatenate([getattr(split, field) for split in splits]) for field in
                   ("starts", "lengths", "target_counts")),
                 shares, any(split.chat_format for split in splits), hashlib.sha256(named.encode()).hexdigest())


def load_sft_data(args):
    """Train and validation Splits of encoded conversations (the validation ones by name), each cut to the largest
    bucket (its first tokens still teach); conversations with no target within that length are left out."""
    corpus = open_prepared(args.data, "--data", conversations=True)
    starts, lengths = np.asarray(corpus.offsets[:-1]), np.diff(corpus.offsets)
    cut = np.minimum(lengths, args.buckets[-1])
    # Targets per conversation: its mask's sum, less its first token's (a first token is never predicted).
    target_counts = np.add.reduceat(corpus.mask, starts, dtype=np.int64) - corpus.mask[starts]
    for i in np.flatnonzero(lengths > cut):  # the few conversations that are cut: count again within the cut
        target_counts[i] = int(corpus.mask[starts[i] + 1:starts[i] + cut[i]].sum())
    is_val = np.isin(np.arange(len(starts)), common.validation_documents(len(starts), args.val_fraction))
    has_targets = target_counts > 0
    train, val = (one_source_split(corpus, corpus.mask, starts[keep], cut[keep], target_counts[keep])
                  for keep in (~is_val & has_targets, is_val & has_targets))
    return train, {source_names([args.data])[0]: val}


# ----------------------------------------------------------------------------------------------
# Length bucketing. A sample sits in the smallest bucket that holds it; an optimizer step takes one
# bucket, and a micro-batch of bucket length L holds tokens_per_batch // L samples, so every step
# computes about the same number of positions whatever the bucket.

def bucket_batch_size(tokens_per_batch, bucket_len):
    return tokens_per_batch // bucket_len


class Schedule:
    """One epoch's optimizer steps as flat arrays: schedule[i] is (bucket length, the samples of step i, all ranks'
    and micro-batches'). Rank r's micro-batch m of a step is samples[m * world_size + r :: world_size * grad_accum]."""

    def __init__(self, samples, starts, ends, bucket_lens):
        self.samples, self.starts, self.ends, self.bucket_lens = samples, starts, ends, bucket_lens

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):  # also what `for bucket_len, samples in schedule` iterates with
        return int(self.bucket_lens[i]), self.samples[self.starts[i]:self.ends[i]]


def epoch_samples(split, seed, epoch):
    """An epoch's samples: each once, or (a mixture) each source's token share, read in passes shuffled anew end to end:
    epoch e takes those that begin in its e-th quota (a small source repeats, a large one reads on)."""
    if split.shares is None:
        return np.arange(len(split.lengths))
    chosen = []
    for source, share in enumerate(split.shares):
        members = np.flatnonzero(split.sources == source)
        size, quota = int(split.lengths[members].sum()), share * int(split.lengths.sum())
        for reading in range(int(epoch * quota // size), int((epoch + 1) * quota // size) + 1):  # the passes it meets
            order = members[np.random.default_rng([seed, source, reading]).permutation(len(members))]
            begins = reading * size + np.cumsum(split.lengths[order]) - split.lengths[order]
            chosen.append(order[(begins >= epoch * quota) & (begins < (epoch + 1) * quota)])
    return np.concatenate(chosen)


def epoch_schedule(lengths, buckets, tokens_per_batch, world_size, grad_accum, seed, epoch, order="shuffled",
                   samples=None):
    """One epoch's optimizer steps, alike on every rank: each bucket's samples (of `samples`, default all) shuffled and
    cut into steps of batch size x grad_accum x world_size, then the steps shuffled or short buckets first."""
    epoch_ids = np.arange(len(lengths)) if samples is None else np.asarray(samples)
    rng = np.random.default_rng([seed, epoch])
    bucket_of = np.searchsorted(buckets, np.asarray(lengths)[epoch_ids])  # the smallest bucket that holds each
    samples, starts, ends, bucket_lens = [], [], [], []
    for b, bucket_len in enumerate(buckets):
        members = epoch_ids[rng.permutation(np.flatnonzero(bucket_of == b))]
        per_step = bucket_batch_size(tokens_per_batch, bucket_len) * grad_accum * world_size
        step_starts, offset = np.arange(0, len(members), per_step), sum(map(len, samples))
        samples.append(members)
        starts.append(offset + step_starts)
        ends.append(offset + np.minimum(step_starts + per_step, len(members)))  # a last step may be short: padded rows
        bucket_lens.append(np.full(len(step_starts), bucket_len))
    n_steps = sum(map(len, starts))
    steps = rng.permutation(n_steps) if order == "shuffled" else np.arange(n_steps)
    return Schedule(np.concatenate(samples), np.concatenate(starts)[steps], np.concatenate(ends)[steps],
                    np.concatenate(bucket_lens)[steps])


def collate(split, sample_ids, bucket_len, batch_size, device):
    """Input ids and targets of the samples at `sample_ids` on `device`, right-padded to the bucket length (no attention
    mask: under the causal one, right padding changes no real token). Target t: token t+1 where that carries a loss."""
    input_ids, targets = (torch.full((batch_size, bucket_len), fill, dtype=torch.long, pin_memory=device.type == "cuda")
                          for fill in (common.EOT_ID, common.IGNORE_INDEX))
    for row, i in enumerate(sample_ids):
        start, n = split.starts[i], split.lengths[i]
        input_ids[row, :n] = torch.from_numpy(sample_tokens(split, i))
        targets[row, :n - 1] = input_ids[row, 1:n]
        mask = split.masks[split.sources[i]]
        if mask is not None:  # conversations: only the assistant's tokens are targets
            not_targets = torch.from_numpy(mask[start + 1:start + n] == 0)
            targets[row, :n - 1].masked_fill_(not_targets, common.IGNORE_INDEX)
    return input_ids.to(device, non_blocking=True), targets.to(device, non_blocking=True)  # from pinned memory: no wait


# ----------------------------------------------------------------------------------------------
# The data order: what the sequence of training samples depends on.

def data_order(args, train, val, world_size, samples_per_rank, batch_flags, bucket_order):
    """What the training samples' order depends on (checkpoints.check_resume: a resume may not change it), once the
    splits have samples: samples_per_rank (a step's samples by bucket on a rank, set by batch_flags), bucket_order."""
    if len(train.lengths) < world_size:
        raise common.UsageError(f"the data gives {len(train.lengths)} training samples, fewer than the {world_size} "
                                f"ranks: use more --data or fewer ranks")
    for name, split in val.items():
        if not len(split.lengths):
            raise common.UsageError(f"the validation split of {name} is empty: use more --data or a larger "
                                    f"--val-fraction")
    return {"data_sha256": train.content_sha256, "val_fraction": args.val_fraction, "buckets": args.buckets,
            "seed": args.seed, "world_size": world_size, "bucket_order": bucket_order,
            "samples_per_step": [n * world_size for n in samples_per_rank],
            "batch_flags": batch_flags}
