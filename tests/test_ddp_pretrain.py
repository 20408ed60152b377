"""ddp_pretrain.py end to end on CPU with gloo: init sanity, metrics, loss normalisation (exact resume:
test_crash.py)."""
import argparse
import json
import math
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import common
from helpers import BUILTIN_TEXT, TINY_RUN, check, copy_checkpoint, read_metrics, run_script


@pytest.fixture(scope="module")
def twenty_steps(tiny_run):
    return tiny_run("ddp_pretrain.py")


def test_first_loss_is_log_vocab_size(twenty_steps):
    train, val = read_metrics(twenty_steps[0])
    assert abs(train[1]["loss"] - math.log(50_304)) < 0.5
    assert abs(val[0] - math.log(50_304)) < 0.5  # evaluated before the first step


def test_every_step_is_logged_with_consistent_token_counts(twenty_steps):
    train, val = read_metrics(twenty_steps[0])
    assert sorted(train) == list(range(1, 21)) and sorted(val) == [0, 10, 20]
    for row in train.values():
        assert row["batch_size"] == 256 // row["bucket_len"]
        assert row["padded_tokens"] == 2 * row["batch_size"] * row["bucket_len"]  # 2 ranks, no accumulation
        assert row["target_tokens"] < row["tokens"] <= row["padded_tokens"]
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0 and row["mfu"] is None  # no peak FLOPs for CPUs
        assert row["peak_reserved_gb"] is None  # no caching allocator on CPU: its peak_mem_gb is what is held
    assert train[1]["lr"] < train[5]["lr"]  # warming up
    assert val[20] < val[0] - 1.0  # it learns


def test_run_prints_the_non_padding_share_of_its_steps(twenty_steps):
    train, _ = read_metrics(twenty_steps[0])
    share = float(re.search(r"non-padding share ([\d.]+)%", twenty_steps[1].stdout).group(1))
    expected = sum(row["tokens"] for row in train.values()) / sum(row["padded_tokens"] for row in train.values())
    assert share == pytest.approx(100 * expected, abs=0.05)  # (the builtin corpus's own share: test_data.py)


def test_keep_last_leaves_the_newest_checkpoints(twenty_steps):
    assert sorted(p.name for p in (twenty_steps[0] / "checkpoints").iterdir()) == ["step_10", "step_20"]


def test_resume_follows_a_new_lr_and_says_what_changed(twenty_steps, tmp_path):
    """A user lowers --lr after a spike and resumes: the first resumed step already uses the new schedule."""
    resumed_dir = copy_checkpoint(twenty_steps[0], 10, tmp_path / "resumed")
    result = check(run_script("ddp_pretrain.py", *TINY_RUN, "--lr", 1e-3, "--max-steps", 12, "--out-dir", resumed_dir,
                              "--resume", nproc=2))
    assert "changed against the checkpoint: --lr 0.001 (was 0.003), --max-steps 12 (was 20)" in result.stdout
    resumed, original = read_metrics(resumed_dir)[0], read_metrics(twenty_steps[0])[0]
    flags = argparse.Namespace(lr=1e-3, warmup_steps=5, max_steps=12, min_lr_ratio=0.1, lr_schedule="cosine")
    assert resumed[11]["lr"] == pytest.approx(common.learning_rate(10, flags), rel=1e-12)
    assert resumed[11]["lr"] < original[11]["lr"] / 2  # not the checkpoint's 3e-3 schedule


def write_unequal_documents(path, n=40, seed=0):
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lengths = [rng.randint(3, 45) for _ in range(n)]
    with open(path, "w") as f:
        for length in lengths:
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(length))}) + "\n")
    return lengths


@pytest.mark.slow  # multi-process runs of its own
def test_gradients_do_not_depend_on_how_the_global_batch_is_split(tmp_path):
    """Same 8 unequal-length samples: 1 rank x 8, 2 ranks x 4, 1 rank x 2 micro-batches x 4."""
    lengths = write_unequal_documents(tmp_path / "docs.jsonl")
    assert len(set(lengths)) > 10  # unequal lengths: a mean of per-batch means would differ
    check(run_script("prepare_data.py", "--data", tmp_path / "docs.jsonl", "--out-dir", tmp_path / "docs"))
    common_flags = ["--model", "tiny", "--data", tmp_path / "docs", "--buckets", 64, "--max-steps", 2,
                    "--warmup-steps", 1]
    layouts = {"1 rank": (1, 512, 1), "2 micro-steps": (1, 256, 2), "2 ranks": (2, 256, 1)}

    def run(name):  # the one-process layouts run side by side: each spends most of its time starting up
        nproc, tokens_per_batch, grad_accum = layouts[name]
        out = tmp_path / name.replace(" ", "_")
        check(run_script("ddp_pretrain.py", *common_flags, "--tokens-per-batch", tokens_per_batch, "--grad-accum",
                         grad_accum, "--out-dir", out, nproc=nproc))
        return read_metrics(out)[0]

    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = dict(zip(layouts, pool.map(run, layouts)))
    reference = rows["1 rank"]
    for name in layouts:
        for step in (1, 2):
            assert rows[name][step]["target_tokens"] == reference[step]["target_tokens"]
            assert rows[name][step]["loss"] == pytest.approx(reference[step]["loss"], abs=1e-5)
            assert rows[name][step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-5)


def test_plain_python_runs_as_a_single_process(tmp_path):
    check(run_script("ddp_pretrain.py", "--model", "tiny", "--data", BUILTIN_TEXT, "--max-steps", 2,
                     "--val-fraction", 0.002, "--out-dir", tmp_path, torchrun=False))
    train, _ = read_metrics(tmp_path)
    assert sorted(train) == [1, 2] and train[1]["padded_tokens"] == train[1]["batch_size"] * train[1]["bucket_len"]
