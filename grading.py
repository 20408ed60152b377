"""How a reply is graded, alike by the SFT's accuracy, GRPO's reward and evaluate.py: its answer (between the solution
markers, or its final number) and its mode; and a split's prompts with their reference answers."""
import re

import common
import data

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


def answer_prompts(tokenizer, split, limit, reward):
    """Prompts (up to and with the last <|assistant|>) and reference answers (reply_answer's) of up to `limit`
    conversations of a split, those with an answer; and a bound on a reply's length."""
    prompts, answers, longest = [], [], 0
    for i in range(min(limit, len(split.lengths))):
        tokens = data.sample_tokens(split, i)
        start = len(tokens) - list(tokens[::-1]).index(common.SPECIAL_TOKENS[common.ROLE_MARKERS["assistant"]])
        answer = reply_answer(tokenizer, tokens[start:], reward)
        if answer is not None:
            prompts.append(tokens[:start].tolist())
            answers.append(answer)
            longest = max(longest, len(tokens) - start)
    return prompts, answers, longest + 16


def is_worked(tokenizer, token_ids):
    """Whether a reply is in the worked mode: its thought holds anything."""
    thought = common.decode(tokenizer, token_ids).partition("<|begin_of_thought|>")[2]
    return "<|end_of_thought|>" in thought and bool(thought.partition("<|end_of_thought|>")[0].strip())
