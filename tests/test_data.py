"""Length bucketing, chunking, splitting, collation and the LR schedule, as the SPEC states them."""
import argparse
import json
from collections import Counter

import numpy as np
import pytest
import torch

import checkpoints
import common
import data
import loading
from helpers import BUILTIN_TEXT, TINY_RUN

BUCKETS = [32, 64, 128]


def random_lengths(n=1000, seed=0):
    return np.random.default_rng(seed).integers(2, 129, size=n)


def rows_of(schedule, world_size, grad_accum):
    """The schedule as [(bucket_len, rows)], rows[rank][micro] a list of sample ids: what each rank feeds."""
    slots = world_size * grad_accum
    return [(bucket_len, [[samples[micro * world_size + rank::slots].tolist() for micro in range(grad_accum)]
                          for rank in range(world_size)])
            for bucket_len, samples in schedule]


def list_schedule(lengths, buckets, tokens_per_batch, world_size, grad_accum, seed, epoch, order="shuffled"):
    """The schedule as the scripts computed it before it became flat arrays (Python lists per sample), kept here
    as the reference the new one must equal bit for bit."""
    rng = np.random.default_rng([seed, epoch])
    bucket_of = np.searchsorted(buckets, lengths)  # the smallest bucket that holds each sample
    steps = []
    for b, bucket_len in enumerate(buckets):
        members = rng.permutation(np.flatnonzero(bucket_of == b)).tolist()
        per_step = data.bucket_batch_size(tokens_per_batch, bucket_len) * grad_accum * world_size
        for start in range(0, len(members), per_step):
            chunk = members[start:start + per_step]
            slots = [chunk[i::world_size * grad_accum] for i in range(world_size * grad_accum)]
            steps.append((bucket_len, [[slots[micro * world_size + rank] for micro in range(grad_accum)]
                                       for rank in range(world_size)]))
    if order == "shuffled":
        steps = [steps[i] for i in rng.permutation(len(steps))]
    return steps


def parse(flags):
    parser = common.get_parser("", "runs/x")
    common.add_batch_arguments(parser)
    parser.add_argument("--data", nargs="+", default=[str(BUILTIN_TEXT)])  # the pretraining scripts', the tests' copy
    presets = loading.script_presets("ddp_pretrain.py")
    return common.finalize_args(common.parse_args(parser, presets, [str(flag) for flag in flags]), None)


@pytest.fixture(scope="module")
def builtin_args():
    return parse([])  # the default job's settings


@pytest.fixture(scope="module")
def builtin_splits(builtin_args):
    return data.load_pretraining_data(builtin_args)


@pytest.mark.parametrize("corpus", ["builtin", "tiny run", "random"])
@pytest.mark.parametrize("world_size,grad_accum,order", [(2, 1, "shuffled"), (2, 3, "shuffled"), (4, 2, "ascending")])
def test_schedule_equals_the_list_schedule_bit_for_bit(corpus, world_size, grad_accum, order, builtin_args,
                                                        builtin_splits):
    if corpus == "builtin":
        lengths, buckets, tokens_per_batch = (builtin_splits[0].lengths, builtin_args.buckets,
                                              builtin_args.tokens_per_batch)
    elif corpus == "tiny run":
        args = parse(TINY_RUN)
        lengths, buckets, tokens_per_batch = (data.load_pretraining_data(args)[0].lengths,
                                              args.buckets, 512)
    else:
        lengths, buckets, tokens_per_batch = random_lengths(), BUCKETS, 512
    for epoch in (0, 1):
        new = data.epoch_schedule(lengths, buckets, tokens_per_batch, world_size, grad_accum, seed=1337, epoch=epoch,
                                  order=order)
        assert rows_of(new, world_size, grad_accum) == list_schedule(lengths, buckets, tokens_per_batch, world_size,
                                                                     grad_accum, 1337, epoch, order)


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_every_sample_is_used_exactly_once_per_epoch(world_size, grad_accum):
    lengths = random_lengths()
    steps = rows_of(data.epoch_schedule(lengths, BUCKETS, 512, world_size, grad_accum, seed=1, epoch=0),
                    world_size, grad_accum)
    used = Counter(i for _, rows in steps for rank_rows in rows for micro in rank_rows for i in micro)
    assert sorted(used) == list(range(len(lengths)))
    assert set(used.values()) == {1}


def test_batch_size_is_tokens_per_batch_over_bucket_length_and_samples_fit_their_bucket():
    lengths = random_lengths()
    tokens_per_batch = 1000
    steps = rows_of(data.epoch_schedule(lengths, BUCKETS, tokens_per_batch, 2, 1, seed=1, epoch=0), 2, 1)
    full_rows = Counter()
    for bucket_len, rows in steps:
        assert len(rows) == 2 and all(len(rank_rows) == 1 for rank_rows in rows)
        for rank_rows in rows:
            micro = rank_rows[0]
            assert len(micro) <= tokens_per_batch // bucket_len
            full_rows[bucket_len] += len(micro) == tokens_per_batch // bucket_len
            smaller = [b for b in BUCKETS if b < bucket_len]
            # the smallest bucket that holds it: longer than the next smaller bucket
            assert all(lengths[i] <= bucket_len and (not smaller or lengths[i] > smaller[-1]) for i in micro)
    assert data.bucket_batch_size(1000, 32) == 31 and data.bucket_batch_size(1000, 128) == 7
    assert all(full_rows[b] > 0 for b in BUCKETS)


def test_schedule_is_a_pure_function_of_seed_and_epoch():
    lengths = random_lengths()
    def make(seed, epoch):
        return rows_of(data.epoch_schedule(lengths, BUCKETS, 512, 2, 1, seed=seed, epoch=epoch), 2, 1)

    assert make(1, 0) == make(1, 0)  # what every rank computes independently: the same buckets, the same step count
    assert make(1, 0) != make(1, 1) and make(1, 0) != make(2, 0)
    assert len(make(1, 0)) == len(make(1, 1))


def test_ascending_order_trains_short_buckets_first():
    schedule = data.epoch_schedule(random_lengths(), BUCKETS, 512, 2, 1, seed=1, epoch=0, order="ascending")
    bucket_lens = [bucket_len for bucket_len, _ in schedule]
    assert bucket_lens == sorted(bucket_lens)


def test_ranks_get_disjoint_samples():
    for _, rows in rows_of(data.epoch_schedule(random_lengths(), BUCKETS, 512, 2, 2, seed=1, epoch=0), 2, 2):
        rank0 = {i for micro in rows[0] for i in micro}
        rank1 = {i for micro in rows[1] for i in micro}
        assert not rank0 & rank1


def test_chunking_makes_every_token_but_the_first_a_target_exactly_once():
    lengths = [1000, 128, 129, 5, 2]  # longer than the bucket, exactly it, one more, short ones
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    corpus = data.Corpus(np.arange(offsets[-1]), offsets, None, False, "")
    starts, sample_lengths = data.document_samples(corpus, np.array([0, 1, 2, 3, 4]), 128)
    assert sample_lengths.max() == 128 and sample_lengths.min() >= 2
    for document, length in enumerate(lengths):
        mine = (starts >= offsets[document]) & (starts < offsets[document + 1])
        targets = np.concatenate([np.arange(s + 1, s + n) for s, n in zip(starts[mine], sample_lengths[mine])])
        assert targets.tolist() == list(range(offsets[document] + 1, offsets[document + 1])), document


def test_validation_documents_are_fixed_and_never_trained_on(builtin_splits):
    train, val = builtin_splits[0], builtin_splits[1]["builtin"]  # 21 of the 411 builtin documents held out
    assert len(val.lengths) > 21 * 3  # whole documents: a long one gives several samples, all held out

    def covered(split):
        mask = np.zeros(len(split.tokens[0]), dtype=bool)
        for start, length in zip(split.starts, split.lengths):
            mask[start:start + length] = True
        return mask

    trained, held_out = covered(train), covered(val)
    assert not (trained & held_out).any() and (trained | held_out).all()  # disjoint, and together the whole corpus
    assert len(common.validation_documents(411, 0.05)) == 21
    assert np.array_equal(common.validation_documents(411, 0.05), common.validation_documents(411, 0.05))
    assert len(common.validation_documents(100_000, 0.05)) == 500  # at most 500 documents


def split_of(samples, mask=None):
    """A Split over the given samples laid end to end (pretraining when mask is None)."""
    lengths = np.array([len(s) for s in samples])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = np.concatenate(samples).astype(np.uint16)
    counts = lengths - 1 if mask is None else np.array([mask[s + 1:s + n].sum() for s, n in zip(starts, lengths)])
    return data.Split([tokens], [mask], np.zeros(len(starts), dtype=np.int64), starts, lengths, counts, None, False, "")


def test_collate_pads_right_and_never_targets_padding():
    split = split_of([np.array([5, 6, 7]), np.array([8, 9])])  # pretraining: every next token is a target
    assert split.target_counts.tolist() == [2, 1]
    input_ids, targets = data.collate(split, [0, 1], bucket_len=4, batch_size=3, device=torch.device("cpu"))
    assert input_ids.tolist() == [[5, 6, 7, common.EOT_ID], [8, 9, common.EOT_ID, common.EOT_ID], [common.EOT_ID] * 4]
    assert targets.tolist() == [[6, 7, -100, -100], [9, -100, -100, -100], [-100] * 4]


def test_collate_targets_only_masked_tokens():
    split = split_of([np.array([1, 2, 3, 4, 5])], mask=np.array([0, 0, 1, 1, 0], dtype=np.uint8))
    assert split.target_counts.tolist() == [2]
    _, targets = data.collate(split, np.array([0]), bucket_len=6, batch_size=1, device=torch.device("cpu"))
    assert targets.tolist() == [[-100, 3, 4, -100, -100, -100]]


def test_builtin_corpus_is_bucketed_with_at_least_90_percent_real_tokens(builtin_args, builtin_splits):
    train, val = builtin_splits
    assert len(train.lengths) > 1000 and len(val["builtin"].lengths) > 50
    schedule = data.epoch_schedule(train.lengths, builtin_args.buckets, builtin_args.tokens_per_batch, 2, 1,
                                   seed=1337, epoch=0)
    computed = sum(2 * data.bucket_batch_size(builtin_args.tokens_per_batch, bucket_len) * bucket_len
                   for bucket_len, _ in schedule)
    share = train.lengths.sum() / computed
    print(f"non-padding share of the builtin corpus over one epoch: {share:.1%}")
    assert share >= 0.90


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    flags = argparse.Namespace(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1, lr_schedule="cosine")
    def lr(step):
        return common.learning_rate(step, flags)

    assert [round(lr(s), 6) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)  # halfway through the cosine: the mean of peak and floor
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 120))


def test_collate_copies_rows_out_of_the_memory_map(builtin_splits):
    train, _ = builtin_splits
    assert isinstance(train.tokens[0], np.memmap)  # the corpus is never read into memory as a whole
    input_ids, _ = data.collate(train, [0], int(train.lengths[0]), 1, torch.device("cpu"))
    assert input_ids.dtype == torch.long and input_ids[0].tolist() == data.sample_tokens(train, 0).tolist()


def test_the_data_order_is_returned_and_nothing_is_written_into_args(builtin_args, builtin_splits):
    before = dict(vars(builtin_args))
    per_rank = [data.bucket_batch_size(builtin_args.tokens_per_batch, length) for length in builtin_args.buckets]
    order = data.data_order(builtin_args, *builtin_splits, 2, per_rank, ["tokens_per_batch", "grad_accum"], "shuffled")
    assert vars(builtin_args) == before
    assert order["samples_per_step"] == [2 * n for n in per_rank] and order["seed"] == builtin_args.seed
    assert order["batch_flags"] == ["tokens_per_batch", "grad_accum"]
    assert order["data_sha256"] == builtin_splits[0].content_sha256 and order["bucket_order"] == "shuffled"


def test_a_resume_may_change_the_ranks_but_not_the_samples_per_step(builtin_args, builtin_splits, tmp_path):
    per_rank = [data.bucket_batch_size(builtin_args.tokens_per_batch, length) for length in builtin_args.buckets]
    flags = ["tokens_per_batch", "grad_accum"], "shuffled"
    order = data.data_order(builtin_args, *builtin_splits, 2, per_rank, *flags)
    meta = {"script": "a", "model": builtin_args.model, "step": 1, "data_order": order, "config": {}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    one_rank_twice_the_batch = data.data_order(builtin_args, *builtin_splits, 1, [2 * n for n in per_rank], *flags)
    checkpoints.check_resume(tmp_path, builtin_args, one_rank_twice_the_batch)  # the same samples per step: accepted
    one_rank = data.data_order(builtin_args, *builtin_splits, 1, per_rank, *flags)
    with pytest.raises(common.UsageError) as error:
        checkpoints.check_resume(tmp_path, builtin_args, one_rank)
    assert str(error.value).startswith(f"--tokens-per-batch {builtin_args.tokens_per_batch} x --grad-accum 1 x 1 ranks")
