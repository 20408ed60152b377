"""evaluate.py against independent computations (closed forms, a hand-made log-likelihood, fsdp2_sft.py's own
accuracy), its bad input, and plot.py on the shared runs."""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import data
import evaluate
import grading
import loading
import modeling
import plot
from helpers import SFT_DATA, TINY_RUN, run_script, traceback_through_our_code


def test_pass_at_k_majority_and_intervals_equal_their_closed_forms():
    # pass@k = 1 - C(n - c, k) / C(n, k): 5 replies, 2 right, 2 drawn -> 1 - 3/10
    assert evaluate.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert evaluate.pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is the share of right replies
    assert evaluate.pass_at_k(4, 3, 2) == 1.0 and evaluate.pass_at_k(5, 0, 3) == 0.0
    assert evaluate.majority_answer(["7", None, "3", "7"]) == "7"
    assert evaluate.majority_answer(["3", "7", "7", "3"]) == "3"  # a tie: the earliest answer
    assert evaluate.majority_answer([None, None]) is None
    # Wilson's 95% intervals as published (e.g. Newcombe 1998): 8/10, 0/10, 10/10
    assert evaluate.wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert evaluate.wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert evaluate.wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    # every proportion lies inside its own interval, exactly (at 200 of 200 the computed bound once fell 1e-16 short)
    assert all(low <= k / n <= high for n in (10, 200, 500) for k in range(n + 1)
               for low, high in [evaluate.wilson_interval(k, n)])
    # The bootstrap of a constant is the constant; of a ratio of sums, it brackets the ratio.
    assert evaluate.bootstrap_interval([2.0] * 50) == pytest.approx((2.0, 2.0))
    low, high = evaluate.bootstrap_interval(np.arange(1, 101), np.full(100, 2.0))
    assert low < 101 / 4 < high and high - low < 10


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return modeling.build_model("tiny").eval()


@pytest.mark.parametrize("chat", [False, True], ids=["pretrained", "chat"])
def test_arith_choice_equals_a_hand_computed_log_likelihood(chat, tiny_model):
    """Each choice's summed log-probability after its prompt, from transformers' logits and log_softmax, one sequence
    at a time; and the task's accuracy and gold bits per byte from those hand-made numbers."""
    tokenizer = common.get_chat_tokenizer()
    args = argparse.Namespace(limit=6, batch_size=16, seed=0, val_fraction=0.05)
    problems = evaluate.task_problems("arith_choice", args)
    contexts, choices = evaluate.choice_prompts(tokenizer, problems, chat, args)
    pairs = [(context, choice) for context in contexts for choice in choices]
    pairs.append((contexts[0], tokenizer.encode_ordinary(" 12, or more than one token")))
    by_hand = []
    with torch.no_grad():
        for context, continuation in pairs:
            logits = tiny_model(input_ids=torch.tensor([context + continuation])).logits[0].double()
            logprobs = torch.log_softmax(logits[len(context) - 1:-1], dim=-1)
            by_hand.append(logprobs[torch.arange(len(continuation)), continuation].sum().item())
    scores = np.array(by_hand[:-1]).reshape(len(problems), 10)
    assert evaluate.choice_scores(tiny_model, contexts, choices, batch_size=4) == pytest.approx(scores, abs=1e-4)
    assert evaluate.continuation_logprobs(tiny_model, pairs, batch_size=7) == pytest.approx(by_hand, abs=1e-4)

    gold = [int(answer.split()[-1].rstrip(".")) for _, _, answer in problems]
    rows = {row["metric"]: row for row in evaluate.arith_choice(tiny_model, tokenizer, args, chat)}
    assert rows["accuracy"]["value"] == np.mean(scores.argmax(1) == gold) and rows["accuracy"]["n"] == 6
    gold_bpb = np.mean([-scores[i, g] / math.log(2) / 2 for i, g in enumerate(gold)])  # " 7" is 2 bytes
    assert rows["gold_bpb"]["value"] == pytest.approx(gold_bpb, rel=1e-5)


def test_generation_metrics_score_known_replies(tiny_model, monkeypatch):
    """Replies made up with a known number right per problem: accuracy, markers, pass@k and maj@k come out as the
    closed forms say."""
    tokenizer = common.get_chat_tokenizer()
    args = argparse.Namespace(limit=5, batch_size=2, seed=0, samples=4, val_fraction=0.05)
    problems = evaluate.task_problems("arith_4op", args)
    index = {tuple(evaluate.chat_prompt(tokenizer, question)): i for i, (question, _, _) in enumerate(problems)}

    def reply(text):
        return tokenizer.encode(text + "<|end_of_turn|>", allowed_special="all")

    right = [reply(problems[i][1]) for i in range(5)]
    wrong = reply("<|begin_of_solution|>\n\nThe answer is 99.\n\n<|end_of_solution|>")

    def made_up(model, prompts, max_new_tokens, batch_size, temperature=0.0):
        if temperature == 0:  # greedy: problems 0, 2, 4 right; 1 wrong; 3 with no markers at all
            return [right[i] if i % 2 == 0 else wrong if i == 1 else reply("no idea")
                    for i in (index[tuple(p)] for p in prompts)]
        seen, out = {}, []  # sampled: problem i has i of its 4 replies right, the right ones first
        for p in prompts:
            i = index[tuple(p)]
            seen[i] = seen.get(i, -1) + 1
            out.append(right[i] if seen[i] < i else wrong)
        return out

    monkeypatch.setattr(evaluate, "replies", made_up)
    rows = {row["metric"]: row["value"] for row in evaluate.generation(tiny_model, tokenizer, args, "arith_4op")}
    correct = [0, 1, 2, 3, 4]  # of 4 replies each (problem 4: 4 of 4)
    assert rows["accuracy"] == 3 / 5 and rows["with_markers"] == 4 / 5
    assert rows["pass@1"] == pytest.approx(np.mean([c / 4 for c in correct]))
    assert rows["pass@2"] == pytest.approx(np.mean([1 - math.comb(4 - c, 2) / 6 for c in correct]))
    assert rows["pass@4"] == 4 / 5  # any right
    assert rows["maj@4"] == 3 / 5  # 2 of 4 right is a tie, won by the earliest (right) answer; 1 of 4 loses


def test_arith_gen_equals_the_sft_scripts_val_accuracy(tiny_run, tmp_path):
    """The same problems as fsdp2_sft.py's held-out accuracy (its prompts and answers, token for token, at the run's
    own --val-fraction, which the checkpoint records), and the same accuracy on its checkpoint; the command writes
    every task's rows."""
    out, _ = tiny_run("fsdp2_sft.py")
    parser = common.get_parser("", str(tmp_path))
    parser.add_argument("--data")  # one folder, as the SFT's
    argv = [*map(str, TINY_RUN), *map(str, SFT_DATA)]
    args = common.finalize_args(common.parse_args(parser, loading.script_presets("fsdp2_sft.py"), argv), None)
    tokenizer = common.get_chat_tokenizer()
    prompts, answers, _ = grading.answer_prompts(tokenizer, data.load_sft_data(args)[1]["builtin-sft"], 8,
                                          "exact-text")
    problems = evaluate.task_problems("arith_gen", argparse.Namespace(limit=8, val_fraction=args.val_fraction))
    assert [evaluate.chat_prompt(tokenizer, question) for question, _, _ in problems] == prompts
    assert [answer for _, _, answer in problems] == answers

    result = run_script("evaluate.py", out / "checkpoints" / "step_20", "--limit", 8, "--samples", 2, "--out",
                        tmp_path / "rows.jsonl")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_accuracy = next(r["val_accuracy"] for r in logged if r["step"] == 20 and "val_accuracy" in r)
    found = {(r["task"], r["metric"]): r for r in rows}
    assert found["arith_gen", "accuracy"]["value"] == val_accuracy
    assert {task for task, _ in found} == set(evaluate.TASKS)
    for task in evaluate.CHAT_TASKS:  # the solve tasks also say how many replies were in the worked mode
        worked = {"worked", "sampled_worked"} if task.startswith("solve") else set()
        assert {metric for t, metric in found if t == task} == {"accuracy", "with_markers", "pass@1", "pass@2",
                                                                 "maj@2", *worked}
    assert {metric for t, metric in found if t != "prose_bpb" and t not in evaluate.CHAT_TASKS} == {"accuracy",
                                                                                                 "gold_bpb"}
    for r in rows:
        assert r["ci_low"] <= r["value"] <= r["ci_high"] and r["step"] == 20 and r["script"] == "fsdp2_sft"
    assert 0 < found["prose_bpb", "bpb"]["value"] < 20 and found["prose_bpb", "bpb"]["n"] > 0
    assert "arith_reworded" in result.stdout and not traceback_through_our_code(result.stdout + result.stderr)
    # A progress bar (stderr) names the checkpoint and the task running.
    assert f"evaluating {out / 'checkpoints' / 'step_20'}" in result.stderr and "arith_reworded" in result.stderr
    assert [path.name for path in tmp_path.iterdir()] == ["rows.jsonl"]  # written beside, then renamed


def test_bad_input_is_one_line(tiny_run, tmp_path):
    cases = [([str(tmp_path)], str(tmp_path), "neither a checkpoint"),  # an empty folder
             ([str(tiny_run("fsdp2_pretrain.py")[0]), "--tasks", "arith_gen"], "--tasks arith_gen", "chat format")]
    for argv, flag, words in cases:
        with pytest.raises(common.UsageError) as error:
            evaluate.evaluate(evaluate.get_parser().parse_args(argv))
        assert "\n" not in str(error.value) and words in str(error.value) and flag in str(error.value)
    # An unknown task is argparse's one line; on the command line, with no traceback.
    result = run_script("evaluate.py", tiny_run("fsdp2_pretrain.py")[0], "--tasks", "prose_bpb,hellaswag")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--tasks" in lines[0] and "hellaswag" in lines[0], lines


def test_plot_draws_each_run_and_each_logged_metric(tiny_run, tmp_path):
    runs = [tiny_run(script)[0] for script in ("ddp_pretrain.py", "fsdp2_pretrain.py", "fsdp2_sft.py",
                                               "fsdp2_grpo.py")]
    panels = plot.plot(runs, tmp_path / "runs.png")
    assert panels == ["training loss against step", "training loss against tokens", "validation loss against step",
                      "held-out answer accuracy against step", "mean reward against step",
                      "replies in the worked mode against step", "reply length (tokens) against step"]
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(tmp_path / "runs.png").shape
    assert width > 6 * height  # seven panels side by side
    # Tokens on the x axis are the running total of each step's tokens.
    series = plot.read_run(runs[0])
    rows = [json.loads(line) for line in (Path(runs[0]) / "metrics.jsonl").read_text().splitlines()]
    assert series["loss", "tokens"][0] == list(np.cumsum([r["tokens"] for r in rows if "loss" in r]))
    with pytest.raises(common.UsageError):
        plot.plot([tmp_path], tmp_path / "none.png")


def test_plot_draws_each_run_in_one_colour_in_every_panel_under_one_legend(tiny_run, tmp_path, monkeypatch):
    """Four runs whose folders are all named "run" (so labelled by their parents too), the output flag among them."""
    runs = [tiny_run(script)[0] for script in ("ddp_pretrain.py", "fsdp2_pretrain.py", "fsdp2_sft.py",
                                               "fsdp2_grpo.py")]
    labels = plot.run_labels(runs)
    assert len(set(labels)) == 4 and all(label.endswith("/run") for label in labels)
    figure = plot.draw(dict(zip(labels, map(plot.read_run, runs))), plot.PANELS)
    colours = {}  # label -> the colours it is drawn in, over every panel
    for axis in figure.axes:
        assert axis.get_legend() is None
        for line in axis.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert sorted(colours) == sorted(labels) and all(len(drawn) == 1 for drawn in colours.values())
    assert len({next(iter(drawn)) for drawn in colours.values()}) == 4 and len(figure.legends) == 1
    monkeypatch.setattr(sys, "argv", ["plot.py", str(runs[0]), "--out", str(tmp_path / "two.png"), str(runs[1])])
    plot.main()
    assert (tmp_path / "two.png").stat().st_size > 0
