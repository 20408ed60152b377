"""What benchmarks/baselines.py feeds each baseline, built from our prepared data with neither trl nor datasets:
HF Trainer's blocks (run_clm's concatenate-and-cut) and TRL's token ids with their labels. The suite builds both
(tests/test_baseline_rows.py), so a change to data.py fails a test rather than the benchmark."""
import common
import data


def trainer_blocks(corpus, block):
    """run_clm's pipeline: every document followed by <|endoftext|>, concatenated, cut into blocks of BLOCK tokens."""
    ids = corpus.tokens.tolist()
    return [ids[i:i + block] for i in range(0, len(ids) - block + 1, block)]


def trl_rows(split):
    """{"input_ids": [...], "labels": [...]}, a row per sample: a label is its token where the token carries a loss
    (an assistant's, in a conversation), else ignored; the model shifts them, as our targets are shifted."""
    rows = {"input_ids": [], "labels": []}
    for i, (start, length) in enumerate(zip(split.starts, split.lengths)):
        tokens, mask = data.sample_tokens(split, i).tolist(), split.masks[split.sources[i]]
        keep = [True] * length if mask is None else (mask[start:start + length] != 0).tolist()
        rows["input_ids"].append(tokens)
        rows["labels"].append([token if kept else common.IGNORE_INDEX for token, kept in zip(tokens, keep)])
    return rows
