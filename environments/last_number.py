"""The last number in the reply is the answer: a lenient grader for pretrained chat models, which
answer in words ("The answer is 15.", "7 + 8 = 15"). Reward 1 when the reply's last number (commas
between digits removed) equals the row's answer as a number, else 0. Single turn."""
import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    found = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return float(found[-1]) if found else None


def interact(messages):
    return []  # single turn


def reward_fn(messages, answer) -> float:
    reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    got = last_number(reply)
    return float(got is not None and got == float(answer))
