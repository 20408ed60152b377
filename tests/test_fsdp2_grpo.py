"""fsdp2_grpo.py on CPU with gloo. The exactness tests fix the rollouts through tests/fixed_rollouts.py (which
patches the library calls and runs the script unchanged); the crash tests (test_crash.py) kill it mid-rollout and
resume it."""
import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import common
import evaluate
import loading
import prepare_data
import tasks
from helpers import (
    RL_DATA,
    TINY_RUN,
    check,
    model_tensors,
    prepare_folder,
    read_metrics,
    reply_saying,
    run_script,
)
from prepare_data import encode_conversation


def fixed(mode, *flags, nproc=2):
    return run_script("tests/fixed_rollouts.py", "fsdp2_grpo.py", *flags, nproc=nproc, env={"ROLLOUTS": mode})


def builtin_prompt_tokens():
    """The shortest built-in RL prompt (system, user, <|assistant|>): a reply has the bucket (72) less that."""
    tokenizer = common.get_chat_tokenizer()
    return min(len(encode_conversation(tokenizer, prepare_data.conversation_messages(row, "builtin")[:-1])[0])
               + 1 for row in tasks.builtin_rl_records())


def test_the_builtin_rl_set_is_solve_questions_answered_right_and_none_of_evaluates_problems():
    rows = tasks.builtin_rl_records()
    sft = {record["conversations"][0]["value"] for record in tasks.builtin_sft_records()}
    args = argparse.Namespace(limit=500, val_fraction=0.05)
    held_out = {question for task in evaluate.CHAT_TASKS for question, _, _ in evaluate.task_problems(task, args)}
    questions = [row["prompt"] for row in rows]
    assert len(set(questions)) == len(rows) and not set(questions) & (sft | held_out)
    for row in rows:
        expression = re.fullmatch(r"Solve ([\d +-]+)\.", row["prompt"]).group(1)
        assert expression.count(" ") == 6  # three operations, as the SFT set's
        assert row["answer"] == f"The answer is {eval(expression)}." and set(row) == {"system", "prompt", "answer"}


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
    # A step's positions: 2 ranks x 8 replies, in micro-batches of 512 // 72 = 7 rollouts padded to 72 tokens: 2 each.
    config = json.loads((out / "config.json").read_text())
    assert config["tokens_per_step"] == 2 * 2 * 7 * 72 == train[1]["padded_tokens"]


def test_equal_rewards_give_zero_loss_and_leave_the_weights_unchanged(tiny_run, tmp_path):
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    out = tmp_path / "grpo"
    check(fixed("constant", *TINY_RUN, *RL_DATA, "--init-from", sft_dir, "--weight-decay", 0, "--max-steps", 2,
                "--eval-generate", 0, "--out-dir", out))
    train, _ = read_metrics(out)
    for row in train.values():
        # every group: one reward
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["zero_spread_groups"] == 1.0
    before = model_tensors(sft_dir / "checkpoints" / "step_20", tmp_path)
    after = model_tensors(out / "checkpoints" / "step_2", tmp_path)
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)


QUESTION = "What is 3 + 4?"


def one_question_data(tmp_path):
    """Six rows of one question: one held out, five training prompts, so at 1 prompt per rank on 2 ranks an epoch is
    two steps of two prompts and one of one."""
    path = tmp_path / "qa.jsonl"
    path.write_text((json.dumps({"prompt": QUESTION, "answer": "The answer is 7."}) + "\n") * 6)  # in its words
    prepare_folder(path, "sft", tmp_path / "qa")
    return tmp_path / "qa"


def test_the_loss_is_the_policy_gradient_computed_in_plain_pytorch_and_a_rank_without_prompts_adds_nothing(tiny_run,
                                                                                                            tmp_path):
    """Six rows of one question (one held out): five training prompts on 2 ranks at 1 prompt per rank, so two steps
    take two groups and the third, the epoch's short one, one group (rank 1 has no prompt). Reply j of a group answers
    j: reply 7 alone is right. With --lr 0 the weights stay the SFT's, so every step's loss and gradient norm are
    those of the objective written here from transformers' full logits: -sum(advantage x log p(token)) / tokens."""
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    check(fixed("answer-by-sample", *TINY_RUN, "--data", one_question_data(tmp_path), "--init-from", sft_dir,
                "--group-size", 10,
                "--prompts-per-step", 1, "--max-steps", 3, "--lr", 0, "--eval-every", 100, "--eval-generate", 0,
                "--out-dir", tmp_path / "grpo"))
    tokenizer = common.get_chat_tokenizer()
    prompt = encode_conversation(tokenizer, [("user", QUESTION)])[0] + [common.SPECIAL_TOKENS["<|assistant|>"]]
    replies = [reply_saying(j) for j in range(10)]
    rewards = torch.tensor([float(j == 7) for j in range(10)])
    advantages = rewards - rewards.mean()
    model, _ = loading.load_checkpoint_model(loading.resolve_checkpoint(sft_dir))
    width = max(len(prompt + reply) for reply in replies)
    input_ids = torch.tensor([prompt + reply + [common.EOT_ID] * (width - len(prompt + reply)) for reply in replies])
    log_probs = torch.log_softmax(model(input_ids=input_ids).logits.float(), dim=-1)
    reply_log_probs = torch.stack([log_probs[j, len(prompt) - 1 + torch.arange(len(reply)), reply].sum()
                                   for j, reply in enumerate(replies)])  # log p of each whole reply
    reply_tokens = sum(map(len, replies))
    loss = -(advantages * reply_log_probs).sum() / reply_tokens
    loss.backward()
    grad_norm = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum().sqrt()
    train, _ = read_metrics(tmp_path / "grpo")
    # the epoch's steps in shuffled order: one of them is the short one
    assert sorted(train[step]["target_tokens"] for step in (1, 2, 3)) == [1 * reply_tokens, 2 * reply_tokens,
                                                                          2 * reply_tokens]
    for step in (1, 2, 3):
        assert train[step]["reward"] == 0.1 and train[step]["zero_spread_groups"] == 0
        assert train[step]["loss"] == pytest.approx(loss.item(), abs=1e-6)
        assert train[step]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)
    assert loss.item() != 0


def test_one_rank_and_two_ranks_take_the_same_steps_on_the_same_rollouts(tiny_run, tmp_path):
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    # Groups of 10 replies answering 0..9: each group has exactly one right reply, whatever its prompt.
    flags = [*TINY_RUN, *RL_DATA, "--init-from", sft_dir, "--group-size", 10, "--max-steps", 3, "--eval-every", 100,
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


def test_ranks_whose_replies_end_at_very_different_lengths_or_that_have_no_prompt_finish_their_steps(tiny_run,
                                                                                                     tmp_path):
    """Real sampling, rank 0's replies cut after 1 token while rank 1's run on; on the one-question data, whose epoch
    ends in a step with a prompt for rank 0 alone: rank 1 then joins every synced forward of the rollout, and the
    gradient sync, with nothing of its own."""
    sft_dir, _ = tiny_run("fsdp2_sft.py")
    result = fixed("uneven", *TINY_RUN, "--data", one_question_data(tmp_path), "--init-from", sft_dir,
                   "--prompts-per-step", 1, "--max-steps", 3, "--eval-every", 100, "--eval-generate", 0,
                   "--out-dir", tmp_path / "grpo")
    check(result)
    train, _ = read_metrics(tmp_path / "grpo")
    assert sorted(train) == [1, 2, 3]
    prompt = encode_conversation(common.get_chat_tokenizer(), [("user", QUESTION)])[0]
    longest = 72 - len(prompt) - 1  # the bucket less the prompt and its <|assistant|>
    short = [row for row in train.values() if row["target_tokens"] == 8]  # rank 0's 8 one-token replies alone
    assert len(short) == 1 and short[0]["reply_tokens"] == 1
    # the full steps: rank 0's replies 1 token, rank 1's ran on
    assert all(1 < row["reply_tokens"] <= (1 + longest) / 2 for row in train.values() if row["target_tokens"] > 8)
