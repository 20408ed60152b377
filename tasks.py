"""The built-in task families, each with its generator, its held-out problems and how a reply is read:

    arithmetic  chains of single-digit additions and subtractions, always worked step by step (the SFT set: chains
                of three; the RL set and evaluate.py: chains of two and four, and other phrasings)
    parity      the parity of a row of bits, answered in one of two modes: directly (the common mode, which a small
                model cannot get right on long rows) or worked (the running parity bit by bit, the rare mode,
                which it can); RL with a correctness reward can select the rare mode

Replies are read alike by the SFT's accuracy, GRPO's reward and evaluate.py: the text between the solution markers,
or the final number."""
import random
import re

import common

REWARDS = ["final-number", "exact-text"]  # GRPO's --reward: how a reply is checked against the reference
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # 72, -3, 1,000, 2.5


def final_number(text):
    """The last number in a text, as a float (so "1,000" and "1000.0" are equal), or None."""
    numbers = NUMBER.findall(text or "")
    return float(numbers[-1].replace(",", "")) if numbers else None


def reply_answer(tokenizer, token_ids, reward):
    """What a reply answers, as --reward compares it: the text between its solution markers (exact-text), or the
    last number there, else the last in the whole reply (final-number). None: no answer."""
    text = solution_text(tokenizer, token_ids)
    if reward == "exact-text":
        return text
    return final_number(text if text is not None else common.decode(tokenizer, token_ids))


def solution_text(tokenizer, token_ids):
    """The text between the solution markers of a reply, or None: what the built-in set's accuracy compares."""
    token_ids = list(token_ids)
    begin, end = common.SPECIAL_TOKENS["<|begin_of_solution|>"], common.SPECIAL_TOKENS["<|end_of_solution|>"]
    if begin not in token_ids or end not in token_ids[token_ids.index(begin):]:
        return None
    start = token_ids.index(begin) + 1
    return common.decode(tokenizer, token_ids[start:token_ids.index(end, start)]).strip()


# ----------------------------------------------------------------------------------------------
# Arithmetic.

def builtin_reasoning_records(n=10_000, seed=0, operations=3):
    """A generated reasoning set in the OpenThoughts format, deterministic by seed: chains of `operations` (three)
    single-digit additions and subtractions whose results stay within 0..9, no problem twice. Each thought
    step does one operation and carries the rest (6 + 2 = 8, so 8 - 6 - 1; ...): every result sits right
    after its operands, and the solution is "The answer is 1.". One chain length on purpose: a 4-layer
    model learns to copy operands by position, and a rarer length is what it then gets wrong (evaluate.py
    asks chains of two and four, out of distribution)."""
    distinct = 10 * 11**operations  # 11 choices per step
    assert n <= 0.9 * distinct, f"there are {distinct:,} distinct problems of {operations} operations; ask for fewer"
    rng, records, seen = random.Random(seed), [], set()
    while len(records) < n:
        value = rng.randint(0, 9)
        terms = [str(value)]
        for _ in range(operations):
            op = rng.choice("+-")
            operand = rng.randint(0, 9 - value) if op == "+" else rng.randint(0, value)  # results stay within 0..9
            value = value + operand if op == "+" else value - operand
            terms += [op, str(operand)]
        question = f"Compute {' '.join(terms)}."
        if question in seen:
            continue
        seen.add(question)
        steps = []
        while len(terms) > 1:
            first, op, operand = int(terms[0]), terms[1], int(terms[2])
            terms = [str(first + operand if op == "+" else first - operand), *terms[3:]]
            steps.append(f"{first} {op} {operand} = {terms[0]}" + (f", so {' '.join(terms)}" if len(terms) > 1 else ""))
        thoughts = "First, " + "; ".join(steps)  # a word first: every number is the same " 5" token as in the question
        answer = (f"<|begin_of_thought|>\n\n{thoughts}\n\n<|end_of_thought|>\n\n"
                  f"<|begin_of_solution|>\n\nThe answer is {value}.\n\n<|end_of_solution|>")
        records.append({"system": common.BUILTIN_SYSTEM_PROMPT, "conversations": [
            {"from": "user", "value": question}, {"from": "assistant", "value": answer}]})
    return records


REPHRASINGS = ["What is {}?", "Calculate {}.", "Find the value of {}.", "{} = ?"]  # the built-in set: "Compute {}."
HELD_OUT_SEED = 1000  # seeds evaluate.py's chains of two and four operations, which no training set holds


def builtin_rl_records():
    """Answer-only problems of shapes the built-in SFT set never shows, for fsdp2_grpo.py: chains of two and of four
    operations, and chains of three (none of the SFT's 10,000) asked in other words. Each row is a prompt and its
    answer in the solution's words ("The answer is 1."), no worked solution. evaluate.py's held-out problems of these
    shapes are left out."""
    held_out = {record["conversations"][0]["value"] for operations in (2, 4)
                for record in builtin_reasoning_records(500, HELD_OUT_SEED, operations)}
    records = [*builtin_reasoning_records(1089, seed=2000, operations=2),  # 1,089: 90% of the 1,210 there are
               *builtin_reasoning_records(3000, seed=2000, operations=4)]
    records = [record for record in records if record["conversations"][0]["value"] not in held_out]
    sft_set = builtin_reasoning_records(11_979)  # its first 10,000 are the SFT's; the rest, what it never saw
    questions = [record["conversations"][0]["value"] for record in records]
    questions += [REPHRASINGS[i % len(REPHRASINGS)].format(record["conversations"][0]["value"][8:-1])
                  for i, record in enumerate(sft_set[10_000:])]  # "Compute 3 + 4 - 2." -> "What is 3 + 4 - 2?"
    replies = [record["conversations"][1]["value"] for record in [*records, *sft_set[10_000:]]]
    answers = [reply.split("<|begin_of_solution|>")[1].split("<|end_of_solution|>")[0].strip() for reply in replies]
    rows = [{"system": common.BUILTIN_SYSTEM_PROMPT, "prompt": question, "answer": answer}
            for question, answer in zip(questions, answers)]
    random.Random(0).shuffle(rows)  # the shapes mixed, so that a validation split holds each
    return rows


# ----------------------------------------------------------------------------------------------
# Parity: two modes of answer.

PARITY_LENGTHS = range(10, 17)  # bits per row in the training sets and the parity task
PARITY_LONG_LENGTHS = range(20, 25)  # longer rows, in no training set: the parity_long task
PARITY_HELD_OUT_SEED = 3000  # seeds the held-out rows of both tasks, which every training set leaves out
PARITY_SFT_ROWS, PARITY_WORKED_SHARE = 4000, 0.1  # the built-in SFT set's parity rows, and the share worked
EMPTY_THOUGHT = "<|begin_of_thought|>\n\n<|end_of_thought|>\n\n"


def parity_question(bits):
    return f"What is the parity of {' '.join(map(str, bits))}?"


def parity_reply(bits, worked):
    """The reply of either mode, ending in the same answer: the parity (1: an odd number of ones). Worked: the running
    parity after each bit, one per bit, so that each step reads one bit and the step before it."""
    running = [sum(bits[:i + 1]) % 2 for i in range(len(bits))]
    thought = (f"<|begin_of_thought|>\n\nRunning: {' '.join(map(str, running))}\n\n<|end_of_thought|>\n\n" if worked
               else EMPTY_THOUGHT)
    return f"{thought}<|begin_of_solution|>\n\nThe answer is {running[-1]}.\n\n<|end_of_solution|>"


def parity_rows(n, seed, lengths=PARITY_LENGTHS, exclude=()):
    """n distinct rows of bits, their lengths drawn evenly from `lengths`, none of them in `exclude`."""
    rng, rows, seen = random.Random(seed), [], set(exclude)
    while len(rows) < n:
        bits = tuple(rng.randint(0, 1) for _ in range(rng.choice(lengths)))
        if bits not in seen:
            seen.add(bits)
            rows.append(bits)
    return rows


def parity_held_out(n=500, lengths=PARITY_LENGTHS):
    """The held-out rows of the parity task (or, at PARITY_LONG_LENGTHS, of parity_long): in no training set."""
    return parity_rows(n, PARITY_HELD_OUT_SEED + lengths[0], lengths)


def parity_sft_rows(n=PARITY_SFT_ROWS):
    return parity_rows(n, 0, exclude=parity_held_out())


def parity_records(n=PARITY_SFT_ROWS, worked_share=PARITY_WORKED_SHARE):
    """The parity rows of the SFT set, in the OpenThoughts format: a share `worked_share` of them worked, the rest
    answered directly (which rows are worked: drawn at random, seeded)."""
    rng = random.Random(1)
    return [{"system": common.BUILTIN_SYSTEM_PROMPT, "conversations": [
        {"from": "user", "value": parity_question(bits)},
        {"from": "assistant", "value": parity_reply(bits, worked=rng.random() < worked_share)}]}
        for bits in parity_sft_rows(n)]


def parity_rl_rows(n, seed=4000):
    """Answer-only parity problems for fsdp2_grpo.py ({prompt, answer}), none of them held out or in the SFT set."""
    return [{"system": common.BUILTIN_SYSTEM_PROMPT, "prompt": parity_question(bits),
             "answer": f"The answer is {sum(bits) % 2}."}
            for bits in parity_rows(n, seed, exclude={*parity_held_out(), *parity_sft_rows()})]


def is_worked(tokenizer, token_ids):
    """Whether a reply is in the worked mode: its thought holds anything."""
    text = common.decode(tokenizer, token_ids)
    if "<|begin_of_thought|>" not in text or "<|end_of_thought|>" not in text:
        return False
    return bool(text.split("<|begin_of_thought|>", 1)[1].split("<|end_of_thought|>", 1)[0].strip())
