"""The design guide's minimal environment: single-turn math scored with verifiers' own checker.

    python -m train.trainer.grpo rollout.env_path=environments/verifiers_math.py rollout.model_name=stub/model \
        data.train_data_path=stub/data/math/train.jsonl data.test_data_path=stub/data/math/test.jsonl \
        data.prompts_per_rollout=4 data.responses_per_prompt=2

Plain data rows (`messages` + `answer`), no taskset: the final reply's answer (its last
`<answer>...</answer>`, else its last `\\boxed{...}`, else the whole reply) is checked against the
row's answer with `verifiers.v1.verify_boxed_math_answer` (math-verify: `1/2` equals `0.5`).
For tasksets with tools use `environments/verifiers_adapter.py`.
"""
import logging
import re

import verifiers.v1 as vf

# math-verify's own timeouts use signal.alarm, which works only in the main thread: env calls run in
# a thread pool, where they would silently score 0, and the rollout already enforces
# rollout.env_timeout_s. Its warning about the disabled timeout is silenced.
logging.getLogger("math_verify").setLevel(logging.ERROR)

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def interact(messages):
    return []  # single turn


def reward_fn(messages, answer) -> float:
    reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    tagged = ANSWER.findall(reply)
    if tagged:
        reply = f"\\boxed{{{tagged[-1]}}}"
    elif "\\boxed{" not in reply:
        reply = f"\\boxed{{{reply.strip()}}}"
    return vf.verify_boxed_math_answer(reply, str(answer), timeout_seconds=None)
