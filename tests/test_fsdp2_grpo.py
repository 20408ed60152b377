"""fsdp2_grpo.py on CPU with gloo. The exactness tests fix the rollouts through tests/fixed_rollouts.py (which
patches the library calls and runs the script unchanged); the crash tests (test_crash.py) kill it mid-rollout and
resume it."""
import argparse
import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import common
import evaluate
import prepare_data
from helpers import SFT_DATA, TINY_RUN, check, model_tensors, read_metrics, run_script

# what tests/fixed_rollouts.py's "constant" replies say
REPLY_7 = "<|begin_of_solution|>\n\nThe answer is 7.\n\n<|end_of_solution|>"


def fixed(mode, *flags, nproc=2, advantages=None):
    env = {"ROLLOUTS": mode, **({"ADVANTAGES": advantages} if advantages else {})}
    return run_script("tests/fixed_rollouts.py", "fsdp2_grpo.py", *flags, nproc=nproc, env=env)


def builtin_prompt_tokens():
    """The shortest built-in RL prompt (system, user, <|assistant|>): a reply has the bucket (72) less that."""
    tokenizer = common.get_chat_tokenizer()
    return min(len(common.encode_conversation(tokenizer, prepare_data.conversation_messages(row, "builtin")[:-1])[0])
               + 1 for row in prepare_data.builtin_rl_records())


def test_the_builtin_rl_set_is_new_shapes_answered_right_and_none_of_evaluates_problems():
    rows = prepare_data.builtin_rl_records()
    sft = {record["conversations"][0]["value"] for record in prepare_data.builtin_reasoning_records()}
    args = argparse.Namespace(limit=500, val_fraction=0.05)
    held_out = {question for task in evaluate.CHAT_TASKS for question, _, _ in evaluate.task_problems(task, args)}
    questions = [row["prompt"] for row in rows]
    assert len(set(questions)) == len(rows) and not set(questions) & (sft | held_out)
    shapes = Counter()
    for row in rows:
        expression = re.fullmatch(r"(?:Compute |What is |Calculate |Find the value of )?([\d +-]+?)(?:\.|\?| = \?)",
                                  row["prompt"]).group(1)
        assert row["answer"] == f"The answer is {eval(expression)}." and set(row) == {"system", "prompt", "answer"}
        shapes[f"{expression.count(' ') // 2} operations" if row["prompt"].startswith("Compute") else "reworded"] += 1
    assert set(shapes) == {"2 operations", "4 operations", "reworded"} and min(shapes.values()) > 500, shapes


def test_grpo_logs_its_rollouts_and_learns_nothing_it_should_not(tiny_run):
    out, _ = tiny_run("fsdp2_grpo.py")
    train, val = read_metrics(out)
    assert sorted(train) == list(range(1, 21)) and sorted(val) == [0, 10, 20]
    for row in train.values():
        assert 0 <= row["reward"] <= 1 and 0 <= row["zero_spread_groups"] <= 1 and 0 <= row["with_markers"] <= 1
        # fits the bucket
        assert row["rollout_s"] > 0 and row["train_s"] > 0 and 1 <= row["reply_tokens"] <= 72 - builtin_prompt_tokens()
        assert row["target_tokens"] == round(row["reply_tokens"] * 2 * 8)  # 2 ranks x 1 prompt x 8 replies
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["val_accuracy"] is not None for row in rows if "val_loss" in row)


def test_equal_rewards_give_zero_loss_and_leave_the_weights_unchanged(tiny_run, tmp_path):
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    out = tmp_path / "grpo"
    check(fixed("constant", *TINY_RUN, *SFT_DATA, "--init-from", sft_dir, "--weight-decay", 0, "--max-steps", 2,
                "--eval-generate", 0, "--out-dir", out))
    train, _ = read_metrics(out)
    for row in train.values():
        # every group: one reward
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["zero_spread_groups"] == 1.0
    before = model_tensors(sft_dir / "checkpoints" / "step_20", tmp_path)
    after = model_tensors(out / "checkpoints" / "step_2", tmp_path)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)


def test_advantages_of_one_give_the_sft_loss_and_gradients_on_the_same_tokens(tiny_run, tmp_path):
    """9 conversations of one question whose reply is exactly what the fixed rollouts say; 1 is held out, 8 make one
    SFT step; GRPO's step is 4 prompts x 2 replies (a group holds 2 at least), the same 8 conversations."""
    record = prepare_data.builtin_reasoning_records(1, seed=5)[0]
    data = tmp_path / "qa.jsonl"
    reply = {"from": "assistant", "value": REPLY_7}
    row = {"system": record["system"], "conversations": [record["conversations"][0], reply]}
    data.write_text((json.dumps(row) + "\n") * 9)
    flags = ["--model", "tiny", "--data", data, "--cache-dir", tmp_path / "cache", "--buckets", 128,
             "--tokens-per-batch", 512, "--val-fraction", 0.1, "--max-steps", 1, "--eval-generate", 0,
             "--dtype", "fp32"]
    # The SFT with lr 0: its step-1 checkpoint holds the weights both runs start from, its row the SFT loss and norm.
    check(run_script("fsdp2_sft.py", *flags, "--init-from", tiny_run("fsdp2_pretrain.py")[0], "--lr", 0,
                     "--out-dir", tmp_path / "sft", nproc=2))
    check(fixed("constant", *flags, "--init-from", tmp_path / "sft", "--group-size", 2, "--prompts-per-step", 2,
                "--out-dir", tmp_path / "grpo", advantages="ones"))
    sft, grpo = read_metrics(tmp_path / "sft")[0][1], read_metrics(tmp_path / "grpo")[0][1]
    _, labels = common.encode_conversation(common.get_chat_tokenizer(), [("assistant", REPLY_7)])
    # the same 8 replies
    assert grpo["target_tokens"] == sft["target_tokens"] == 8 * sum(label != common.IGNORE_INDEX for label in labels)
    assert grpo["loss"] == pytest.approx(sft["loss"], abs=1e-6)
    assert grpo["grad_norm"] == pytest.approx(sft["grad_norm"], abs=1e-6)


def test_one_rank_and_two_ranks_take_the_same_steps_on_the_same_rollouts(tiny_run, tmp_path):
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    # Groups of 10 replies answering 0..9: each group has exactly one right reply, whatever its prompt.
    flags = [*TINY_RUN, *SFT_DATA, "--init-from", sft_dir, "--group-size", 10, "--max-steps", 3, "--eval-every", 100,
             "--eval-generate", 0]
    layouts = [("two", 2, 2), ("one", 1, 4)]  # name, ranks, prompts per rank: 4 prompts a step either way

    def run(layout):  # side by side
        name, nproc, prompts = layout
        return check(fixed("answer-by-sample", *flags, "--prompts-per-step", prompts, "--out-dir", tmp_path / name,
                           nproc=nproc))

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(run, layouts))
    two, one = read_metrics(tmp_path / "two")[0], read_metrics(tmp_path / "one")[0]
    for step in (1, 2, 3):
        # every group: a signal
        assert one[step]["reward"] == two[step]["reward"] == 0.1 and two[step]["zero_spread_groups"] == 0
        assert one[step]["loss"] == pytest.approx(two[step]["loss"], abs=1e-6)
        assert one[step]["grad_norm"] == pytest.approx(two[step]["grad_norm"], abs=1e-6)
    assert two[1]["loss"] != 0


def test_ranks_whose_replies_end_at_very_different_lengths_finish_their_steps(tiny_run, tmp_path):
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    result = fixed("uneven", *TINY_RUN, *SFT_DATA, "--init-from", sft_dir, "--max-steps", 3, "--eval-every", 100,
                   "--eval-generate", 0, "--out-dir", tmp_path / "grpo")
    check(result)
    train, _ = read_metrics(tmp_path / "grpo")
    assert sorted(train) == [1, 2, 3]
    longest = 72 - builtin_prompt_tokens()
    # rank 0's replies: 1 token; rank 1's ran on
    assert all(1 < row["reply_tokens"] <= (1 + longest) / 2 for row in train.values())
