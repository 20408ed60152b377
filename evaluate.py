"""Every stage on one scale: a checkpoint of any script scored on built-in tasks, offline, with 95% intervals.

    python evaluate.py runs/fsdp2_pretrain                        # a pretrained model: prose_bpb and arith_choice
    python evaluate.py runs/fsdp2_sft --samples 8 --out sft.jsonl  # a chat model: every task, pass@k and maj@8 too
    python evaluate.py runs/fsdp2_grpo --tasks arith_4op,arith_reworded --limit 100

PATH is a checkpoint folder, a run folder (its newest checkpoint) or an export_hf.py folder. The tasks:

    prose_bpb       bits per byte on the held-out documents of the built-in corpus (pretraining's validation split):
                    comparable across tokenizers and stages, so it shows what SFT and RL cost in prose
    arith_choice    the held-out built-in problems as ten-way choice, each answer digit ranked by its likelihood right
                    after the question, with no working (a pretrained model: a few-shot plain-text prompt; a chat
                    model: its reply format with the thought left empty): accuracy, and gold_bpb (bits per byte of
                    the right answer)
    arith_gen       greedy replies to the held-out problems: accuracy (fsdp2_sft.py's val_accuracy, at --limit equal to
                    its --eval-generate) and with_markers;
                    with --samples N also pass@k (k = 1, 2, 4, ..., N) and maj@N of N replies at temperature 1
    arith_2op       as arith_gen, on chains of two operations (the built-in set holds chains of three only)
    arith_4op       as arith_gen, on chains of four operations
    arith_reworded  as arith_gen, on the held-out problems asked in four other phrasings
    solve           greedy replies to held-out chains of three asked "Solve 3 + 4 - 2." (the SFT set answers most of
                    its solve rows at once, a few worked; tasks.py): accuracy, and worked, the share of replies in the
                    worked mode; with --samples also sampled_worked
    solve_long      as solve, on arith_4op's chains of four operations, a length no training set holds

The last six need a model that learned the chat format (fsdp2_sft.py's, fsdp2_grpo.py's, or a midtrained one).
Intervals: Wilson's for a proportion, a bootstrap over the examples for a mean. Prints a table; --out also writes one
JSON row per (task, metric).
"""
import argparse
import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import checkpoints
import common
import grading
import loading
import modeling
import prepare_data
import tasks

TASKS = ["prose_bpb", "arith_choice", "arith_gen", "arith_2op", "arith_4op", "arith_reworded", "solve", "solve_long"]
CHAT_TASKS = ["arith_gen", "arith_2op", "arith_4op", "arith_reworded", "solve", "solve_long"]
VAL_FRACTION = 0.05  # the scripts' default --val-fraction, for a checkpoint that does not record its own
FEW_SHOT = 3  # solved problems before the question, for a pretrained model
Z = 1.959964  # the normal distribution's 97.5% point: 95% intervals


# ----------------------------------------------------------------------------------------------
# Intervals and the sampling metrics, in closed form.

def wilson_interval(successes, n):
    """The 95% Wilson score interval of a proportion: unlike the normal one, it stays inside [0, 1] and is not
    empty at 0 or n successes."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = successes / n, Z * Z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # at 0 or n successes the bound is the proportion itself (computed, it may miss it by a rounding error)
    return 0.0 if successes == 0 else max(0.0, center - half), 1.0 if successes == n else min(1.0, center + half)


def bootstrap_interval(numerators, denominators=None, seed=0, resamples=1000):
    """A 95% percentile-bootstrap interval of sum(numerators) / sum(denominators) (a mean, without denominators),
    resampling the examples."""
    numerators = np.asarray(numerators, dtype=np.float64)
    denominators = np.ones_like(numerators) if denominators is None else np.asarray(denominators, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(numerators), size=(resamples, len(numerators)))
    ratios = numerators[picks].sum(1) / denominators[picks].sum(1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def pass_at_k(n, correct, k):
    """The unbiased estimate of pass@k from n replies of which `correct` are right: the chance that k of them, drawn
    without replacement, hold at least one right one (Chen et al., 2021)."""
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def majority_answer(answers):
    """The most frequent answer among the replies that have one (the earliest, on a tie), or None."""
    counts = Counter(answer for answer in answers if answer is not None)
    return counts.most_common(1)[0][0] if counts else None


# ----------------------------------------------------------------------------------------------
# The model's numbers: summed log-probabilities, and replies.

@torch.no_grad()
def continuation_logprobs(model, pairs, batch_size):
    """For each (context, continuation) pair of token lists, the summed log-probability of the continuation's tokens
    after the context, from the model's own loss (the chunked cross-entropy the scripts train with)."""
    device = next(model.parameters()).device
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))  # less padding per batch
    scores = [0.0] * len(pairs)
    for start in range(0, len(order), batch_size):
        rows = [pairs[i] for i in order[start:start + batch_size]]
        width = max(len(context) + len(continuation) for context, continuation in rows)
        input_ids = torch.full((len(rows), width), common.EOT_ID)
        targets = torch.full((len(rows), width), common.IGNORE_INDEX)
        for row, (context, continuation) in enumerate(rows):
            input_ids[row, :len(context) + len(continuation)] = torch.tensor(context + continuation)
            targets[row, len(context) - 1:len(context) + len(continuation) - 1] = torch.tensor(continuation)
        hidden = model.model(input_ids=input_ids.to(device)).last_hidden_state
        for row, i in enumerate(order[start:start + batch_size]):  # one row at a time: each example's own sum
            loss = modeling.chunked_cross_entropy(hidden[row:row + 1], model.lm_head.weight,
                                                  targets[row:row + 1].to(device))
            scores[i] = -loss.float().item()
    return scores


@torch.no_grad()
def choice_scores(model, contexts, choices, batch_size):
    """The log-probability of each one-token choice right after each context: an array (contexts, choices), from one
    forward per context (right-padded; causal attention leaves its last real position as it was)."""
    assert all(len(choice) == 1 for choice in choices), "one token per choice"
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(contexts), batch_size):
        rows = contexts[start:start + batch_size]
        input_ids = torch.full((len(rows), max(map(len, rows))), common.EOT_ID)
        for row, context in enumerate(rows):
            input_ids[row, :len(context)] = torch.tensor(context)
        hidden = model.model(input_ids=input_ids.to(device)).last_hidden_state
        last = hidden[torch.arange(len(rows)), torch.tensor([len(context) - 1 for context in rows])]
        logprobs = torch.log_softmax((last @ model.lm_head.weight.T).float(), dim=-1)
        scores.append(logprobs[:, [choice[0] for choice in choices]].cpu().numpy())
    return np.concatenate(scores).astype(np.float64)


@torch.no_grad()
def replies(model, prompts, max_new_tokens, batch_size, temperature=0.0):
    """The new tokens of each prompt, greedy or sampled at `temperature` (no top-k), batch_size prompts at a time."""
    out = []
    for start in range(0, len(prompts), batch_size):
        out += modeling.generate_replies(model, prompts[start:start + batch_size], max_new_tokens, temperature)
    return out


# ----------------------------------------------------------------------------------------------
# The built-in problems: the held-out ones, and the shapes no run trained on.

def held_out(items, val_fraction):
    """The items of the scripts' validation split at that --val-fraction (common.validation_documents)."""
    return [items[i] for i in common.validation_documents(len(items), val_fraction)]


def arith_held_out(val_fraction):
    """The arithmetic records of the built-in SFT set's validation split at that --val-fraction: never trained on."""
    return [record for record in held_out(tasks.builtin_sft_records(), val_fraction)
            if record["conversations"][0]["value"].startswith("Compute ")]


def problem(record, question=None):
    """(question, reference reply, reference answer) of a built-in record; the answer is the text between the
    solution markers, as the scripts compare it."""
    turns = record["conversations"]
    reply = turns[1]["value"]
    answer = reply.split("<|begin_of_solution|>")[1].split("<|end_of_solution|>")[0].strip()
    return question or turns[0]["value"], reply, answer


def task_problems(task, args):
    """The problems of one generation task, at most args.limit; deterministic."""
    if task in ("solve", "solve_long"):  # each with its worked reply, the longer of the two modes
        return [problem(record, tasks.solve_question(record)) for record in tasks.solve_held_out(
            min(args.limit, 500), operations=3 if task == "solve" else 4)]
    if task in ("arith_2op", "arith_4op"):  # in no training data: every training set's chains are of three
        return [problem(record) for record in tasks.builtin_reasoning_records(  # 500: as a held-out split holds
            min(args.limit, 500), tasks.HELD_OUT_SEED, operations=int(task[6]))]
    records = arith_held_out(args.val_fraction)[:args.limit]
    if task != "arith_reworded":
        return [problem(record) for record in records]
    # Each problem in another phrasing, in turn: "Compute 3 + 4 - 2 + 1." becomes "What is 3 + 4 - 2 + 1?", ...
    return [problem(record, tasks.REPHRASINGS[i % len(tasks.REPHRASINGS)].format(
        record["conversations"][0]["value"].removeprefix("Compute ").removesuffix(".")))
        for i, record in enumerate(records)]


def chat_prompt(tokenizer, question):
    """A question in the chat format, up to and with the assistant marker: the prompt fsdp2_sft.py's accuracy uses."""
    messages = [("system", tasks.BUILTIN_SYSTEM_PROMPT), ("user", question)]
    tokens, _ = prepare_data.encode_conversation(tokenizer, messages)
    return tokens + [common.SPECIAL_TOKENS[common.ROLE_MARKERS["assistant"]]]


# ----------------------------------------------------------------------------------------------
# The tasks. Each returns rows {"metric", "value", "n", "ci_low", "ci_high"}.

def row(metric, value, n, interval):
    return {"metric": metric, "value": value, "n": n, "ci_low": interval[0], "ci_high": interval[1]}


def proportion(metric, successes, n):
    return row(metric, successes / n, n, wilson_interval(successes, n))


PROSE_WINDOW = {"tiny": 128, "small": 256, "qwen2-0.5b": 2048}  # each preset's longest pretraining bucket
PROSE_WINDOW.update({f"{preset}-moe": window for preset, window in PROSE_WINDOW.items()})  # its MoE's: the same


def prose_bpb(model, tokenizer, args, window):
    """Bits per byte of the held-out documents, each read in windows of the preset's longest bucket that overlap by
    one token (as the scripts cut samples) after an <|endoftext|>, so that every token of a document is predicted."""
    documents = held_out(prepare_data.builtin_documents(), args.val_fraction)[:args.limit]
    pairs, owner = [], []
    for i, text in enumerate(documents):
        tokens = [common.EOT_ID, *tokenizer.encode_ordinary(text)]
        for start in range(0, len(tokens) - 1, window - 1):
            pairs.append((tokens[start:start + 1], tokens[start + 1:start + window]))
            owner.append(i)
    bits = np.zeros(len(documents))
    np.add.at(bits, owner, -np.asarray(continuation_logprobs(model, pairs, args.batch_size)) / math.log(2))
    n_bytes = np.array([len(text.encode("utf-8")) for text in documents])
    return [row("bpb", bits.sum() / n_bytes.sum(), len(documents), bootstrap_interval(bits, n_bytes, args.seed))]


def choice_prompts(tokenizer, problems, chat, args):
    """The context before the answer digit of each problem, and the ten choices (" 0" ... " 9")."""
    choices = [tokenizer.encode_ordinary(f" {digit}") for digit in range(10)]
    if chat:  # the reply's own format, its thought left empty: the model answers with no working
        opening = tokenizer.encode("<|begin_of_thought|>\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\nThe answer "
                                   "is", allowed_special=set(common.REASONING_MARKERS), disallowed_special=())
        return [chat_prompt(tokenizer, question) + opening for question, _, _ in problems], choices
    # A pretrained model sees solved problems of the training split first, then the question.
    records = tasks.builtin_reasoning_records()
    held = {problem(record)[0] for record in arith_held_out(args.val_fraction)}
    shots = random.Random(args.seed).sample([problem(r) for r in records[:2000] if problem(r)[0] not in held], FEW_SHOT)
    examples = "".join(f"{question} {answer}\n" for question, _, answer in shots)
    return [tokenizer.encode_ordinary(f"{examples}{question} The answer is") for question, _, _ in problems], choices


def arith_choice(model, tokenizer, args, chat):
    problems = task_problems("arith_choice", args)
    contexts, choices = choice_prompts(tokenizer, problems, chat, args)
    scores = choice_scores(model, contexts, choices, args.batch_size)
    gold = np.array([int(answer.removeprefix("The answer is ").removesuffix(".")) for _, _, answer in problems])
    right = int((scores.argmax(1) == gold).sum())
    gold_bits = -scores[np.arange(len(gold)), gold] / math.log(2) / np.array([len(f" {g}".encode()) for g in gold])
    return [proportion("accuracy", right, len(problems)),
            row("gold_bpb", float(gold_bits.mean()), len(problems), bootstrap_interval(gold_bits, seed=args.seed))]


def generation(model, tokenizer, args, task):
    """Greedy exact match and markers; with --samples, pass@k and maj@N of sampled replies."""
    problems = task_problems(task, args)
    prompts = [chat_prompt(tokenizer, question) for question, _, _ in problems]
    # The reply bound fsdp2_sft.py uses: the longest reference reply (with its end marker), plus 16 tokens.
    max_new_tokens = 16 + max(len(prepare_data.encode_conversation(tokenizer, [("assistant", reply)])[0]) - 1
                              for _, reply, _ in problems)
    greedy = replies(model, prompts, max_new_tokens, args.batch_size)
    answers = [grading.solution_text(tokenizer, reply) for reply in greedy]
    n = len(problems)
    rows = [proportion("accuracy", sum(a == p[2] for a, p in zip(answers, problems)), n),
            proportion("with_markers", sum(a is not None for a in answers), n)]
    if task.startswith("solve"):
        rows.append(proportion("worked", sum(grading.is_worked(tokenizer, reply) for reply in greedy), n))
    if args.samples:
        torch.manual_seed(args.seed)
        sampled_replies = replies(model, [p for p in prompts for _ in range(args.samples)], max_new_tokens,
                                  args.batch_size, temperature=1.0)
        sampled = [grading.solution_text(tokenizer, reply) for reply in sampled_replies]
        per_problem = [sampled[i * args.samples:(i + 1) * args.samples] for i in range(n)]
        right = [sum(a == p[2] for a in group) for group, p in zip(per_problem, problems)]
        for k in sorted({*(2**i for i in range(args.samples.bit_length()) if 2**i <= args.samples), args.samples}):
            values = [pass_at_k(args.samples, c, k) for c in right]
            rows.append(row(f"pass@{k}", float(np.mean(values)), n, bootstrap_interval(values, seed=args.seed)))
        rows.append(proportion(f"maj@{args.samples}", sum(majority_answer(group) == p[2]
                                                          for group, p in zip(per_problem, problems)), n))
        if task.startswith("solve"):
            worked = sum(grading.is_worked(tokenizer, reply) for reply in sampled_replies)
            rows.append(proportion("sampled_worked", worked, n * args.samples))
    return rows


# ----------------------------------------------------------------------------------------------
# The command.

def task_list(text):
    tasks = [task.strip() for task in text.split(",") if task.strip()]
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(f"unknown task {', '.join(unknown) or '(none)'}: choose from "
                                         f"{', '.join(TASKS)}")
    return tasks


def get_parser():
    parser = common.ArgumentParser(__doc__)
    parser.add_argument("checkpoint", metavar="PATH",
                        help="a checkpoint folder, a run folder (its newest checkpoint) or an export_hf.py folder")
    parser.add_argument("--tasks", type=task_list, default=None,
                        help=f"comma-separated, of {', '.join(TASKS)} (default: every task the model can do)")
    parser.add_argument("--limit", type=common.COUNT, default=200,
                        help="at most this many problems or documents per task (a task holds at most 500)")
    parser.add_argument("--samples", type=common.NON_NEGATIVE_INT, default=0,
                        help="replies sampled per problem at temperature 1 for pass@k and maj@N (0: none)")
    parser.add_argument("--seed", type=common.NON_NEGATIVE_INT, default=0,
                        help="seeds the sampling, the few-shot examples and the bootstrap")
    parser.add_argument("--batch-size", type=common.COUNT, default=256, help="sequences per forward or generate call")
    parser.add_argument("--out", default=None, help="also write the rows to this JSON-lines file")
    parser.add_argument("--base", default=None, help="a LoRA run: where its base lies now, if moved (default: where "
                        "the run recorded it)")
    return parser


def evaluate(args):
    """The rows of every task for the checkpoint at args.checkpoint, each with its task and the checkpoint's name."""
    checkpoint_dir = loading.resolve_checkpoint(args.checkpoint)
    meta = checkpoints.read_meta(checkpoint_dir, "PATH")
    # Held out: the split the checkpoint's own run validated on (at the default, every default run's).
    args.val_fraction = meta.get("config", {}).get("val_fraction", VAL_FRACTION)
    chat = meta.get("chat_format", False)  # a chat script's model, or a midtrained one (conversations as text)
    tasks = args.tasks or [task for task in TASKS if chat or task not in CHAT_TASKS]
    if not chat and any(task in CHAT_TASKS for task in tasks):
        raise common.UsageError(f"--tasks {','.join(t for t in tasks if t in CHAT_TASKS)} needs a model that learned "
                                f"the chat format (fsdp2_sft.py's, fsdp2_grpo.py's, or a pretraining run's on "
                                f"conversations); {checkpoint_dir} is {meta['script']}'s: use --tasks "
                                f"prose_bpb,arith_choice")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, meta = loading.load_checkpoint_model(checkpoint_dir, device, args.base)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)  # batched inference in bf16 on a GPU; the scores are summed in fp32
    tokenizer = common.get_chat_tokenizer()
    window = PROSE_WINDOW[meta["model"]]
    rows = []
    progress = tqdm(tasks, desc=f"evaluating {checkpoint_dir}", unit="task", dynamic_ncols=True)
    for task in progress:
        progress.set_postfix_str(task)  # the task now running: a generation task takes a while on a CPU
        if task == "prose_bpb":
            task_rows = prose_bpb(model, tokenizer, args, window)
        elif task == "arith_choice":
            task_rows = arith_choice(model, tokenizer, args, chat)
        else:
            task_rows = generation(model, tokenizer, args, task)
        rows += [{"task": task, **r, "checkpoint": str(checkpoint_dir), "script": meta["script"], "step": meta["step"]}
                 for r in task_rows]
    return rows


def main():
    args = get_parser().parse_args()
    started = time.perf_counter()
    rows = evaluate(args)
    print(f"{rows[0]['checkpoint']} ({rows[0]['script']}, step {rows[0]['step']})")
    print(f"{'task':<16}{'metric':<14}{'value':>9}  {'95% interval':<19}{'n':>6}")
    for r in rows:
        interval = f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]"
        print(f"{r['task']:<16}{r['metric']:<14}{r['value']:>9.4f}  {interval:<19}{r['n']:>6}")
    print(f"evaluated in {time.perf_counter() - started:.1f} s")
    if args.out:  # whole or not at all: written beside, then renamed (two evaluations into one file: the later's)
        partial = Path(args.out).with_name(f".{Path(args.out).name}.partial-{os.getpid()}")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(partial, args.out)


if __name__ == "__main__":
    main()
