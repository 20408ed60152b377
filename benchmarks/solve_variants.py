"""SFT sets for the question behind docs/rl.md's solve_long row: which SFT set makes the worked mode right on chains
of four operations, a length the solve family never asks? Writes DIR/mix13.jsonl, DIR/lead13.jsonl, DIR/mix13x6.jsonl
(benchmarks/solve_variants.sh trains on each; `--data builtin` is the baseline):

    mix13    the built-in SFT set, plus every chain of one and two operations but arith_2op's 500 held-out ones, each
             3 times asked "Compute ..." and worked, and once as a solve row (15% worked, as the built-in solve rows)
    lead13   mix13 with each "Compute" asked by one of six lead-ins of 1 to 5 words, drawn at random
    mix13x6  mix13 with the short chains 6 times instead of 3

    python benchmarks/solve_variants.py DIR"""
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import tasks  # noqa: E402

LEADS = ["Compute", "Now compute", "Please compute the value of", "Work out", "Evaluate", "Tell me"]
HELD_OUT_2OP = {r["conversations"][0]["value"] for r in tasks.builtin_reasoning_records(500, tasks.HELD_OUT_SEED, 2)}


def solve_row(record, rng):
    worked = rng.random() < tasks.SOLVE_WORKED_SHARE
    return {"system": record["system"], "conversations": [
        {"from": "user", "value": tasks.solve_question(record)},
        {"from": "assistant", "value": record["conversations"][1]["value"] if worked else tasks.direct_reply(record)}]}


def short_chains(repeats):
    """Chains of one and two operations, each `repeats` times as a worked Compute row and once as a solve row."""
    rng, rows = random.Random(5), []
    for operations, n in ((1, 99), (2, 1089)):  # 90% of the 110 and 1,210 there are
        records = [r for r in tasks.builtin_reasoning_records(n, 0, operations)
                   if r["conversations"][0]["value"] not in HELD_OUT_2OP]
        rows += records * repeats + [solve_row(r, rng) for r in records]
    rng.shuffle(rows)
    return rows


def with_leads(rows):
    """Each Compute row asked with a lead-in drawn at random: the first operand then sits at no fixed distance
    from the reply."""
    rng, out = random.Random(7), []
    for row in rows:
        question = row["conversations"][0]["value"]
        if question.startswith("Compute "):
            row = {"system": row["system"], "conversations": [
                {"from": "user", "value": rng.choice(LEADS) + question.removeprefix("Compute")},
                row["conversations"][1]]}
        out.append(row)
    return out


if __name__ == "__main__":
    builtin = tasks.builtin_sft_records()
    variants = {"mix13": builtin + short_chains(3), "lead13": with_leads(builtin + short_chains(3)),
                "mix13x6": builtin + short_chains(6)}
    for name, rows in variants.items():
        Path(sys.argv[1], f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(name, len(rows))
