"""The single-turn math environments: exact match (`environments/eq.py`), the last number of the
reply (`environments/last_number.py`) and the design guide's minimal verifiers environment
(`environments/verifiers_math.py`)."""
from __future__ import annotations

import threading

import pytest

from conftest import ROOT, load_file


def load_env(name: str):
    return load_file(ROOT / "environments" / f"{name}.py")


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "93 + 75"}, {"role": "assistant", "content": text}]


@pytest.mark.parametrize("text,answer,reward", [
    ("<answer>168</answer>", "168", 1.0),
    ("think... <answer>1</answer> no: <answer> 168. </answer>", "168", 1.0),  # the last tag, normalised
    ("168", "168", 1.0),  # no tag: the whole reply
    ("  The Answer  ", ["x", "the answer"], 1.0),  # case, spaces, a list of answers
    ("the answer is 168", "168", 0.0),  # untagged replies must match whole
    ("<answer>169</answer> 168", "168", 0.0),  # a tag wins over the rest of the reply
    ("", "", 0.0),  # an empty reply never matches
])
def test_exact_match(text, answer, reward):
    assert load_env("eq").reward_fn(reply(text), answer) == reward


@pytest.mark.parametrize("text,answer,reward", [
    ("The answer is 15.", "15", 1.0),
    ("7 + 8 = 15", "15", 1.0),
    ("7 + 8 = 15, not 16", "15", 0.0),  # the last number counts, not any number
    ("That makes 1,234 apples.", "1234", 1.0),  # thousands separators
    ("It is 2, 3 or 4", "4", 1.0),  # a comma between numbers is not a separator
    ("5 - 9 = -4", "-4", 1.0),
    ("15.0", "15", 1.0),  # compared as numbers
    ("fifteen", "15", 0.0),
    ("", "0", 0.0),
])
def test_last_number(text, answer, reward):
    assert load_env("last_number").reward_fn(reply(text), answer) == reward


@pytest.mark.parametrize("text,answer,reward", [
    ("<answer>168</answer>", "168", 1.0),
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("0.5", "1/2", 1.0),
    ("<answer>169</answer>", "168", 0.0),
    ("no idea", "168", 0.0),
])
def test_verifiers_math_scores_in_a_worker_thread(text, answer, reward):
    """Env calls run in threads, where math-verify's signal-based timeouts would silently score 0."""
    env = load_env("verifiers_math")
    got = []
    worker = threading.Thread(target=lambda: got.append(env.reward_fn(reply(text), answer)))
    worker.start()
    worker.join(60)
    assert got == [reward]
