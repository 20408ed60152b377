"""The built-in task families (tasks.py): the parity family's two modes, their shares, held-out rows that no training
set holds, and its replies read as the reward reads them."""
import pytest

import common
import tasks


def test_a_parity_reply_of_either_mode_ends_in_the_parity_and_only_the_worked_one_thinks():
    tokenizer = common.get_chat_tokenizer()
    bits = (1, 0, 1, 1, 0, 0, 1, 0, 1, 1)
    for worked in (True, False):
        reply = tasks.parity_reply(bits, worked)
        tokens, _ = common.encode_conversation(tokenizer, [("assistant", reply)])
        assert tasks.solution_text(tokenizer, tokens) == "The answer is 0."  # six ones: even
        assert tasks.reply_answer(tokenizer, tokens, "final-number") == 0.0
        assert tasks.is_worked(tokenizer, tokens) == worked
    # the worked chain is the running parity, one value per bit, its last the answer
    assert "Running: 1 1 0 1 1 1 0 0 1 0\n" in tasks.parity_reply(bits, True)


def test_the_sft_rows_hold_the_worked_mode_at_its_share_and_are_deterministic():
    records = tasks.parity_records(2000, worked_share=0.1)
    assert records == tasks.parity_records(2000, worked_share=0.1)
    worked = sum("Running:" in record["conversations"][1]["value"] for record in records)
    assert worked / len(records) == pytest.approx(0.1, abs=0.02)  # a binomial draw: 3 standard deviations
    lengths = {len(record["conversations"][0]["value"].split()) - 5 for record in records}
    assert lengths == set(tasks.PARITY_LENGTHS)


def test_held_out_rows_are_in_no_training_set():
    held_out = {tasks.parity_question(bits) for lengths in (tasks.PARITY_LENGTHS, tasks.PARITY_LONG_LENGTHS)
                for bits in tasks.parity_held_out(500, lengths)}
    assert len(held_out) == 1000
    sft = {record["conversations"][0]["value"] for record in tasks.parity_records()}
    rl = [row["prompt"] for row in tasks.parity_rl_rows(2000)]
    assert len(sft) == tasks.PARITY_SFT_ROWS and len(set(rl)) == 2000
    assert not held_out & sft and not held_out & set(rl) and not sft & set(rl)
    long_lengths = {len(question.split()) - 5 for question in held_out} - set(tasks.PARITY_LENGTHS)
    assert long_lengths == set(tasks.PARITY_LONG_LENGTHS)  # lengths that no training row has
