"""Length bucketing, chunking, collation and the LR schedule, as the SPEC states them."""
import argparse
from collections import Counter

import numpy as np
import pytest
import torch

import common

BUCKETS = [32, 64, 128]


def random_lengths(n=1000, seed=0):
    return np.random.default_rng(seed).integers(2, 129, size=n).tolist()


@pytest.mark.parametrize("world_size,grad_accum", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_every_sample_is_used_exactly_once_per_epoch(world_size, grad_accum):
    lengths = random_lengths()
    steps = common.epoch_schedule(lengths, BUCKETS, 512, world_size, grad_accum, seed=1, epoch=0)
    used = Counter(i for _, rows in steps for rank_rows in rows for micro in rank_rows for i in micro)
    assert sorted(used) == list(range(len(lengths)))
    assert set(used.values()) == {1}


def test_batch_size_is_tokens_per_batch_over_bucket_length_and_samples_fit_their_bucket():
    lengths = random_lengths()
    tokens_per_batch = 1000
    steps = common.epoch_schedule(lengths, BUCKETS, tokens_per_batch, 2, 1, seed=1, epoch=0)
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
    assert common.bucket_batch_size(1000, 32) == 31 and common.bucket_batch_size(1000, 128) == 7
    assert all(full_rows[b] > 0 for b in BUCKETS)


def test_schedule_is_a_pure_function_of_seed_and_epoch():
    lengths = random_lengths()
    make = lambda seed, epoch: common.epoch_schedule(lengths, BUCKETS, 512, 2, 1, seed=seed, epoch=epoch)
    assert make(1, 0) == make(1, 0)  # what every rank computes independently: the same buckets, the same step count
    assert make(1, 0) != make(1, 1) and make(1, 0) != make(2, 0)
    assert len(make(1, 0)) == len(make(1, 1))


def test_ascending_order_trains_short_buckets_first():
    steps = common.epoch_schedule(random_lengths(), BUCKETS, 512, 2, 1, seed=1, epoch=0, order="ascending")
    bucket_lens = [bucket_len for bucket_len, _ in steps]
    assert bucket_lens == sorted(bucket_lens)


def test_ranks_get_disjoint_samples():
    steps = common.epoch_schedule(random_lengths(), BUCKETS, 512, 2, 2, seed=1, epoch=0)
    for _, rows in steps:
        rank0 = {i for micro in rows[0] for i in micro}
        rank1 = {i for micro in rows[1] for i in micro}
        assert not rank0 & rank1


def test_chunking_makes_every_token_but_the_first_a_target_exactly_once():
    tokens = np.arange(1000)
    chunks = common.chunk_document(tokens, 128)
    assert max(len(c) for c in chunks) == 128
    targets = np.concatenate([c[1:] for c in chunks])
    assert targets.tolist() == list(range(1, 1000))


def test_collate_pads_right_and_never_targets_padding():
    samples = [np.array([5, 6, 7]), np.array([8, 9])]
    split = common.make_split(samples, samples)  # pretraining: every next token is a target
    assert split.target_counts == [2, 1]
    input_ids, targets = common.collate(split, [0, 1], bucket_len=4, batch_size=3)
    assert input_ids.tolist() == [[5, 6, 7, common.EOT_ID], [8, 9, common.EOT_ID, common.EOT_ID], [common.EOT_ID] * 4]
    assert targets.tolist() == [[6, 7, -100, -100], [9, -100, -100, -100], [-100] * 4]


def test_collate_targets_only_labelled_tokens():
    tokens, labels = np.array([1, 2, 3, 4, 5]), np.array([-100, -100, 3, 4, -100])
    split = common.make_split([tokens], [labels])
    assert split.target_counts == [2]
    _, targets = common.collate(split, [0], bucket_len=6, batch_size=1)
    assert targets.tolist() == [[-100, 3, 4, -100, -100, -100]]


def test_builtin_corpus_is_bucketed_with_at_least_90_percent_real_tokens():
    args = common.finalize_args(common.get_parser("", "runs/x").parse_args([]))  # the default job's settings
    train, val = common.load_pretraining_data(args, common.get_tokenizer())
    assert len(train.tokens) > 1000 and len(val.tokens) > 50
    lengths = train.lengths
    steps = common.epoch_schedule(lengths, args.buckets, args.tokens_per_batch, 2, 1, seed=args.seed, epoch=0)
    computed = sum(2 * common.bucket_batch_size(args.tokens_per_batch, bucket_len) * bucket_len for bucket_len, _ in steps)
    share = sum(lengths) / computed
    print(f"non-padding share of the builtin corpus over one epoch: {share:.1%}")
    assert share >= 0.90


def test_train_and_validation_splits_are_disjoint_and_fixed():
    samples = [np.array([i, i + 1]) for i in range(500)]
    train, val = common.split_train_val(samples, 0.05)
    train_ids, val_ids = {int(s[0]) for s in train}, {int(s[0]) for s in val}
    assert len(val) == 25 and not train_ids & val_ids and len(train_ids | val_ids) == 500
    assert [int(s[0]) for s in common.split_train_val(samples, 0.05)[1]] == [int(s[0]) for s in val]


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    flags = argparse.Namespace(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lr = lambda step: common.learning_rate(step, flags)
    assert [round(lr(s), 6) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.55)  # halfway through the cosine: the mean of peak and floor
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 120))
