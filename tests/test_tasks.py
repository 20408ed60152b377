"""The built-in task families (tasks.py): the solve family's two modes, their share, held-out problems that no
training set holds, and its replies read as the reward reads them."""
import pytest

import common
import grading
import tasks
from prepare_data import encode_conversation


def test_a_solve_reply_of_either_mode_ends_in_the_answer_and_only_the_worked_one_thinks():
    tokenizer = common.get_chat_tokenizer()
    record = tasks.builtin_reasoning_records(1)[0]
    assert tasks.solve_question(record) == "Solve " + record["conversations"][0]["value"][len("Compute "):]
    answer = grading.solution_text(tokenizer, encode_conversation(tokenizer, [
        ("assistant", record["conversations"][1]["value"])])[0])
    for reply, worked in [(record["conversations"][1]["value"], True), (tasks.direct_reply(record), False)]:
        tokens, _ = encode_conversation(tokenizer, [("assistant", reply)])
        assert grading.solution_text(tokenizer, tokens) == answer and answer.startswith("The answer is ")
        assert grading.is_worked(tokenizer, tokens) == worked
    assert tasks.direct_reply(record).startswith(tasks.EMPTY_THOUGHT + "<|begin_of_solution|>")


def test_the_sft_rows_hold_the_worked_mode_at_its_share_and_are_deterministic():
    records = tasks.solve_records(worked_share=0.15)
    assert records == tasks.solve_records(worked_share=0.15) and len(records) == tasks.SOLVE_SFT_ROWS
    worked = sum("First, " in record["conversations"][1]["value"] for record in records)
    assert worked / len(records) == pytest.approx(0.15, abs=0.02)  # a binomial draw: 3 standard deviations
    assert all(record["conversations"][0]["value"].startswith("Solve ") for record in records)
    assert tasks.builtin_sft_records()[:10_000] == tasks.builtin_reasoning_records()  # the arithmetic first
    assert all("First, " in record["conversations"][1]["value"] for record in tasks.solve_records(worked_share=1))


def test_held_out_problems_are_in_no_training_set():
    def chain(question):  # "Solve 3 + 4 - 2." and "Compute 3 + 4 - 2." ask the same chain
        return question.split(" ", 1)[1]

    held_out = {chain(record["conversations"][0]["value"]) for operations in (3, 4)
                for record in tasks.solve_held_out(500, operations)}
    assert len(held_out) == 1000
    arithmetic = tasks.builtin_reasoning_records()
    sft = {chain(record["conversations"][0]["value"]) for record in tasks.builtin_sft_records()}
    rl = [chain(row["prompt"]) for row in tasks.builtin_rl_records()]
    assert len(sft) == 10_000 and len(set(rl)) == len(rl) == tasks.UNSEEN_CHAINS - 500  # solve rows ask trained chains
    assert not held_out & sft and not held_out & set(rl) and not sft & set(rl)
    # No solve row asks a chain that arith_gen holds out, at any --val-fraction (each split is within the first 500).
    validation = common.validation_documents(10_000 + tasks.SOLVE_SFT_ROWS, 1.0)
    arith_held_out = {chain(arithmetic[i]["conversations"][0]["value"]) for i in validation if i < 10_000}
    assert len(arith_held_out) > 300 and set(common.validation_documents(13_000, 0.01)) <= set(validation)
    assert not arith_held_out & {chain(record["conversations"][0]["value"]) for record in tasks.solve_records()}
