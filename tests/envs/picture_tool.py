"""A test environment whose tool replies carry pictures (tests/dist_checks.py `vision`, test_vlm_training.py).

Turn 1: the tool answers with a text line and a picture (its colour from the reply's length, so samples of
a group see different pictures); turn 2: a reply with an image that cannot be decoded when the conversation
asks for one (its user message says "broken"), else the episode ends. The reward is the reply length's
parity: a signal that differs within a group."""
from PIL import Image


def interact(messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    reply = messages[-1]["content"]
    if turns == 1 and "plain" in str(messages[0]["content"]):  # a text-only conversation stays text-only
        return [{"role": "tool", "content": "nothing to see"}]
    if turns == 1:
        shade = (37 * len(reply)) % 256
        return [{"role": "tool", "content": [{"type": "text", "text": "seen:"},
                                             {"type": "image", "image": Image.new("RGB", (40, 70), (shade, 90, 255 - shade))}]}]
    if turns == 2 and "broken" in str(messages[0]["content"]):
        return [{"role": "tool", "content": [{"type": "image", "url": "data:image/png;base64,AAAA"}]}]
    return []


def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)
