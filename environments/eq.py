"""Exact match: the answer inside the last <answer>...</answer> of the final assistant turn,
normalised (case, surrounding spaces and punctuation, inner whitespace), must equal the row's answer."""
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text) -> str:
    text = str(text).strip().lower()
    text = re.sub(r"\s+", " ", text)
    return text.strip(" .,;:!\"'`")


def extract_answer(text: str) -> str | None:
    found = ANSWER.findall(text)
    return found[-1] if found else None


def interact(messages):
    return []  # single turn


def reward_fn(messages, answer) -> float:
    reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    got = extract_answer(reply)
    if got is None:
        return 0.0
    answers = answer if isinstance(answer, list) else [answer]
    return float(any(normalize(got) == normalize(a) for a in answers))
