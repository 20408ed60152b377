"""Midtraining: a pretraining script started from a checkpoint's weights (--init-from), on a weighted mixture of
sources (--data SOURCE:WEIGHT ...), with warmup-stable-decay. Each source gets its share of an epoch's tokens, every
source's validation loss is logged, the weights come over exactly, and a killed mixture run resumes exactly."""
import argparse
import json
import math

import numpy as np
import pytest

import checkpoints
import common
import data
import loading
import plot
from helpers import BUILTIN_SFT, TINY_DATA, TINY_RUN, check, copy_checkpoint, read_metrics, run_script


def two_sources(sizes=(300, 40), seed=0):
    """A mixture Split of two sources of random sample lengths (no tokens: the schedule needs none)."""
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(2, 129, size=n) for n in sizes]
    return data.Split([None, None], [None, None], np.concatenate([np.full(n, i) for i, n in enumerate(sizes)]),
                      np.zeros(sum(sizes), dtype=np.int64), np.concatenate(lengths), np.concatenate(lengths) - 1,
                      np.array([0.7, 0.3]), False, "")


def test_a_mixture_gives_each_source_its_share_of_every_epochs_tokens():
    """Source 1 holds about 12% of the tokens and is asked for 30%: it repeats, a pass at a time, each pass in its
    own order; source 0 (88%, asked for 70%) is read on across epochs, no sample twice before it has given all."""
    split = two_sources()
    sizes = [int(split.lengths[split.sources == i].sum()) for i in (0, 1)]
    total, seen = sum(sizes), []
    for epoch in range(4):
        samples = data.epoch_samples(split, seed=1, epoch=epoch)
        assert np.array_equal(samples, data.epoch_samples(split, seed=1, epoch=epoch))  # a pure function
        tokens = [int(split.lengths[samples[split.sources[samples] == i]].sum()) for i in (0, 1)]
        for share, got in zip(split.shares, tokens):  # each within one sample of its quota
            assert abs(got - share * total) <= 128, (epoch, tokens)
        seen += samples[split.sources[samples] == 0].tolist()
    first_pass = seen[:int(np.sum(split.sources == 0))]
    assert len(set(first_pass)) == len(first_pass)  # the larger source: every sample once before any repeats
    schedule = data.epoch_schedule(split.lengths, [32, 64, 128], 512, 2, 1, 1, 0, samples=data.epoch_samples(split, 1,
                                                                                                                 0))
    assert sorted(np.concatenate([samples for _, samples in schedule]).tolist()) == sorted(
        data.epoch_samples(split, 1, 0).tolist())  # the schedule takes exactly the epoch's samples


def test_sources_parse_with_their_weights_or_none():
    assert data.parse_sources(["data/builtin:0.7", "data/builtin-sft:0.3"]) == [("data/builtin", 0.7),
                                                                               ("data/builtin-sft", 0.3)]
    assert data.parse_sources(["a:3", "b:1"]) == [("a", 0.75), ("b", 0.25)]
    assert data.parse_sources(["data/fineweb-edu", "C:/x"]) == [("data/fineweb-edu", None), ("C:/x", None)]
    assert data.source_names(["data/builtin", "/tmp/a/corpus", "data/fineweb-edu/", "b/corpus"]) == [
        "builtin", "corpus-1", "fineweb-edu", "corpus-3"]


def test_wsd_warms_up_holds_the_peak_then_decays_to_the_floor_linearly_or_as_one_minus_sqrt():
    def lr(step, shape):
        flags = argparse.Namespace(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1, lr_schedule="wsd",
                                   decay_fraction=0.2, decay_shape=shape)
        return common.learning_rate(step, flags)

    for shape in ("linear", "1-sqrt"):
        assert [round(lr(s, shape), 6) for s in (0, 9)] == [0.1, 1.0]
        assert all(lr(s, shape) == 1.0 for s in range(10, 89))  # stable until the last 22 steps (20% of 110)
        assert all(lr(s, shape) > lr(s + 1, shape) for s in range(88, 109)) and lr(110, shape) == pytest.approx(0.1)
    assert lr(99, "linear") == pytest.approx(0.1 + 0.9 * (1 - 11 / 22))  # halfway through the decay
    assert lr(99, "1-sqrt") == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(11 / 22)))


@pytest.fixture(scope="module")
def midtraining(tiny_run, tmp_path_factory):
    """FSDP2 on 2 ranks from the shared FSDP2 run's last weights, on the tests' corpus and the built-in conversations
    60:40, warmup-stable-decay over 20 steps. Returns (out_dir, flags)."""
    out = tmp_path_factory.mktemp("mid") / "run"
    flags = [*TINY_RUN, "--data", f"{TINY_DATA}:0.6", f"{BUILTIN_SFT}:0.4", "--init-from",
             tiny_run("fsdp2_pretrain.py")[0], "--lr-schedule", "wsd", "--decay-fraction", 0.5]
    check(run_script("fsdp2_pretrain.py", *flags, "--out-dir", out, nproc=2))
    return out, flags


def test_midtraining_starts_from_the_weights_and_logs_each_sources_validation_loss(tiny_run, midtraining, tmp_path):
    out, flags = midtraining
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validation = [row for row in rows if "val_loss" in row]
    assert [row["step"] for row in validation] == [0, 10, 20]
    # Step 0 evaluates the FSDP2 run's last weights: on the corpus they share, its last validation loss.
    assert validation[0]["val_loss/tiny_corpus"] == pytest.approx(read_metrics(tiny_run("fsdp2_pretrain.py")[0])[1][20],
                                                                   abs=1e-6)
    # val_loss: the sources' losses weighted by their target tokens.
    parser = common.get_parser("", "runs/x")
    parser.add_argument("--data", nargs="+")
    parser.add_argument("--init-from")
    args = common.parse_args(parser, loading.script_presets("ddp_pretrain.py"), list(map(str, flags)))
    _, val = data.load_pretraining_data(common.finalize_args(args, None))
    counts = {name: int(split.target_counts.sum()) for name, split in val.items()}
    assert sorted(counts) == ["builtin-sft", "tiny_corpus"]
    for row in validation:
        mean = sum(row[f"val_loss/{name}"] * count for name, count in counts.items()) / sum(counts.values())
        assert row["val_loss"] == pytest.approx(mean, rel=1e-6)
    train = {row["step"]: row for row in rows if "loss" in row}
    assert {train[step]["lr"] for step in range(5, 11)} == {3e-3} and train[20]["lr"] < train[12]["lr"] < 3e-3  # wsd
    config = json.loads((out / "config.json").read_text())
    assert config["flags"]["init_from"] == str(tiny_run("fsdp2_pretrain.py")[0])
    assert validation[-1]["val_loss/builtin-sft"] < validation[0]["val_loss/builtin-sft"] - 1  # it learns them
    # The model learned the chat format (conversations read as text): its checkpoints say so, the source run's do not.
    assert json.loads((out / "checkpoints" / "step_20" / "meta.json").read_text())["chat_format"] is True
    assert checkpoints.read_meta(loading.resolve_checkpoint(tiny_run("fsdp2_pretrain.py")[0]), "x")[
        "chat_format"] is False
    assert {"validation loss: builtin-sft against step", "validation loss: tiny_corpus against step"} <= set(
        plot.plot([out], tmp_path / "mid.png"))  # a panel per source


@pytest.mark.parametrize("script", ["ddp_pretrain.py", "fsdp1_pretrain.py"])  # FSDP2's: the midtraining fixture
def test_init_from_carries_the_weights_exactly(script, tiny_run, tmp_path):
    """With --lr 0, one step changes nothing: the new run's checkpoint holds its source checkpoint's every tensor."""
    source = loading.resolve_checkpoint(tiny_run(script)[0])
    check(run_script(script, *TINY_RUN, "--init-from", source, "--lr", 0, "--max-steps", 1, "--eval-every", 100,
                     "--out-dir", tmp_path, nproc=2))
    before, _ = loading.load_checkpoint_model(source)
    after, _ = loading.load_checkpoint_model(loading.resolve_checkpoint(tmp_path))
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(before.state_dict().values(),
                                                                      after.state_dict().values()))


def test_a_mixture_run_resumes_exactly(midtraining, tmp_path):
    """From step 10, across the epoch's end at 12: each source's place in its passes is restored. (What a crash leaves
    behind, and that its step_10 is this very checkpoint, is test_crash.py's.)"""
    out, flags = midtraining
    resumed = copy_checkpoint(out, 10, tmp_path / "resumed")
    check(run_script("fsdp2_pretrain.py", *flags, "--out-dir", resumed, "--resume", nproc=2))
    ours, uninterrupted = read_metrics(resumed)[0], read_metrics(out)[0]
    for step in range(11, 21):
        assert ours[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], abs=1e-6)
        assert ours[step]["bucket_len"] == uninterrupted[step]["bucket_len"]
