"""Math answers checked by math-verify (as in Open-Reasoner-Zero): the final assistant turn's
<answer>...</answer> (or its last \\boxed{...}, or the whole reply) must be mathematically
equal to the row's answer."""
import logging
import re

from math_verify import parse, verify

# We disable math-verify's signal-based timeouts (see below); silence its per-call warning.
logging.getLogger("math_verify").setLevel(logging.ERROR)

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def interact(messages):
    return []


def reward_fn(messages, answer) -> float:
    reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    found = ANSWER.findall(reply)
    candidate = found[-1] if found else reply
    # math-verify's own timeouts use signal.alarm, which only works in the main thread; env calls
    # run in a thread pool and the rollout already enforces rollout.env_timeout_s.
    gold = parse(str(answer) if "$" in str(answer) or "\\" in str(answer) else f"${answer}$",
                 parsing_timeout=None)
    pred = parse(candidate if "\\boxed" in candidate or "$" in candidate else f"${candidate}$",
                 parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))
