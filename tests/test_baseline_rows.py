"""benchmarks/baseline_rows.py: what benchmarks/baselines.py feeds HF Trainer and TRL, built from our prepared data
(no trl needed): TRL's labels carry a loss on exactly our targets, and Trainer's blocks are the corpus, cut."""
import sys

import common
import data
import loading
from helpers import BUILTIN_SFT, REPO, TINY_DATA

sys.path.insert(0, str(REPO / "benchmarks"))
from baseline_rows import trainer_blocks, trl_rows  # noqa: E402


def test_trl_labels_are_our_targets_and_trainer_blocks_the_corpus(tmp_path):
    args = common.finalize_args(common.parse_args(common.get_parser("", tmp_path), loading.script_presets(
        "fsdp2_sft.py"), ["--model", "tiny", "--out-dir", str(tmp_path)]), None)
    args.data = str(BUILTIN_SFT)  # as baselines.py sets it
    train, _ = data.load_sft_data(args)
    rows = trl_rows(train)
    assert len(rows["input_ids"]) == len(train.lengths) > 0
    for i, (input_ids, labels) in enumerate(zip(rows["input_ids"], rows["labels"])):
        assert input_ids == data.sample_tokens(train, i).tolist()
        # The model shifts the labels: position t is trained on labels[t + 1], as our target t is token t + 1.
        assert sum(label != common.IGNORE_INDEX for label in labels[1:]) == train.target_counts[i]
        assert all(label in (token, common.IGNORE_INDEX) for label, token in zip(labels, input_ids))
    corpus = data.open_prepared(TINY_DATA, "--data")
    blocks = trainer_blocks(corpus, 64)
    assert {len(block) for block in blocks} == {64} and len(blocks) == len(corpus.tokens) // 64
    assert sum(blocks, []) == corpus.tokens[:64 * len(blocks)].tolist()
