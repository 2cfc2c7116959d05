"""A test environment whose conversations grow past 16K tokens (tests/integration/test_context_parallel.py): after
each of the first three turns the user pastes a long log of digits (each digit one token of the stub's vocabulary),
so the last turn is sampled, and trained, at the end of a ~17K-token conversation. The reward is a function of
everything the policy said (its characters' codes mod 5): a signal that differs within a group."""
import random

LOG_DIGITS = 5600


def interact(messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    if turns >= 4:
        return []
    digits = random.Random(turns * 1009 + len(messages[-1]["content"])).choices("0123456789", k=LOG_DIGITS)
    return [{"role": "user", "content": "log: " + "".join(digits)}]


def reward_fn(messages, answer):
    said = "".join(m["content"] for m in messages if m["role"] == "assistant")
    return sum(map(ord, said)) % 5 / 4
