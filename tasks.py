"""The built-in task families, each with its generator and its held-out problems:

    arithmetic  chains of single-digit additions and subtractions, always worked step by step (the SFT set: chains
                of three; evaluate.py also asks chains of two and four, and other phrasings)
    solve       chains of three asked "Solve 3 + 4 - 2." and answered in one of two modes: directly (the common
                mode, which a small model gets wrong on a chain it has not seen) or worked as the arithmetic set
                works its chains (the rare mode, which it gets right); RL with a correctness reward selects it. The
                SFT set asks chains the arithmetic rows hold; the held-out and RL sets, chains they leave out

What a data preparation writes and evaluate.py asks: the training scripts grade replies with grading.py."""
import functools
import random

import common

BUILTIN_SYSTEM_PROMPT = "Reason step by step."  # the system prompt of the built-in conversations


# ----------------------------------------------------------------------------------------------
# Arithmetic.

def builtin_reasoning_records(n=10_000, seed=0, operations=3):
    """generated_reasoning_records(n, seed, operations) as a new list (its records are shared: read them only)."""
    return list(generated_reasoning_records(n, seed, operations))


@functools.cache  # evaluate.py asks for these once per task and checkpoint: generate them once per process
def generated_reasoning_records(n, seed, operations):
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
        records.append({"system": BUILTIN_SYSTEM_PROMPT, "conversations": [
            {"from": "user", "value": question}, {"from": "assistant", "value": answer}]})
    return records


REPHRASINGS = ["What is {}?", "Calculate {}.", "Find the value of {}.", "{} = ?"]  # the built-in set: "Compute {}."
HELD_OUT_SEED = 1000  # seeds evaluate.py's chains of two and four operations, which no training set holds


# ----------------------------------------------------------------------------------------------
# Solve: chains of three asked in other words and answered in two modes.

UNSEEN_CHAINS = 1979  # the chains of three operations the arithmetic set leaves out: 11,979 (the 90% cap) - 10,000
SOLVE_HELD_OUT = 500  # of those: the solve task's; the rest are the RL set's
SOLVE_SFT_ROWS = 3000  # the SFT set's solve rows, each asking a chain an arithmetic row of its training split holds
SOLVE_WORKED_SHARE = 0.15  # the share of the SFT set's solve rows that are worked (the rest answer at once)
EMPTY_THOUGHT = "<|begin_of_thought|>\n\n<|end_of_thought|>\n\n"


def solve_question(record):
    """An arithmetic record's question in the solve family's words: "Compute 3 + 4 - 2." -> "Solve 3 + 4 - 2."."""
    return "Solve " + record["conversations"][0]["value"].removeprefix("Compute ")


def direct_reply(record):
    """An arithmetic record's reply in the direct mode: the thought left empty, the same solution."""
    reply = record["conversations"][1]["value"]
    return EMPTY_THOUGHT + reply[reply.index("<|begin_of_solution|>"):]


def unseen_chains():
    """The chains of three operations that no arithmetic row holds, in a fixed order."""
    return builtin_reasoning_records(10_000 + UNSEEN_CHAINS)[10_000:]


def solve_held_out(n=SOLVE_HELD_OUT, operations=3):
    """The held-out problems of the solve task (chains of three), or of solve_long (of four: arith_4op's problems)."""
    return unseen_chains()[:n] if operations == 3 else builtin_reasoning_records(n, HELD_OUT_SEED, operations)


def solve_records(worked_share=SOLVE_WORKED_SHARE):
    """The solve rows of the SFT set, in the OpenThoughts format: chains that the arithmetic rows train on, asked
    "Solve ...", a share `worked_share` of them worked as the arithmetic row works it, the rest answered directly
    (which chains, which rows worked: drawn at random, seeded). The worked mode is then one the SFT can learn to get
    right; the direct one, on a chain it has not seen, mostly a guess. No chain of the SFT set's validation split at
    any --val-fraction (the first 500 of one permutation) is asked, so arith_gen's held-out problems stay unseen."""
    arithmetic = builtin_reasoning_records()
    validation = set(common.validation_documents(len(arithmetic) + SOLVE_SFT_ROWS, 1.0).tolist())
    rng = random.Random(1)
    chosen = rng.sample([i for i in range(len(arithmetic)) if i not in validation], SOLVE_SFT_ROWS)
    return [{"system": BUILTIN_SYSTEM_PROMPT, "conversations": [
        {"from": "user", "value": solve_question(arithmetic[i])},
        {"from": "assistant", "value": arithmetic[i]["conversations"][1]["value"] if rng.random() < worked_share
         else direct_reply(arithmetic[i])}]} for i in chosen]


def builtin_sft_records(worked_share=SOLVE_WORKED_SHARE):
    """The built-in SFT set: the arithmetic conversations (all worked), then the solve rows (a share worked). A fixed
    order: the scripts' validation split is positions in it."""
    return builtin_reasoning_records() + solve_records(worked_share)


def builtin_rl_records():
    """The built-in RL set: the solve family's questions that no other set holds, with their answers only."""
    return [{"system": BUILTIN_SYSTEM_PROMPT, "prompt": solve_question(record),
             "answer": direct_reply(record).split("<|begin_of_solution|>")[1].split("<|end_of_solution|>")[0].strip()}
            for record in unseen_chains()[SOLVE_HELD_OUT:]]
