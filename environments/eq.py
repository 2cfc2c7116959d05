"""Exact match: the final assistant turn's answer, normalised (case, surrounding spaces and
punctuation, inner whitespace), must equal the row's answer (or one of a list of answers). The answer
is the content of the last <answer>...</answer> when the reply has one, else the whole reply."""
import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize(text) -> str:
    text = str(text).strip().lower()
    text = re.sub(r"\s+", " ", text)
    return text.strip(" .,;:!\"'`")


def extract_answer(text: str) -> str:
    """The last tagged answer, else the whole text."""
    found = ANSWER.findall(text)
    return found[-1] if found else text


def interact(messages):
    return []  # single turn


def reward_fn(messages, answer) -> float:
    reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    got = normalize(extract_answer(reply))
    answers = answer if isinstance(answer, list) else [answer]
    return float(bool(got) and any(got == normalize(a) for a in answers))
