"""Chat-template tokenization with action masks, token in / token out.

`tokenize_messages` turns a whole conversation into ids + action_mask (1 on assistant
tokens up to and including the end-of-turn token). During rollout the model's own tokens are
kept as sampled; `continuation_ids` only produces the template/tool tokens that follow them.
Both check that the template tokenizes *increasingly*: appending messages never changes the
tokens of earlier ones. Templates that break this (e.g. ones that strip reasoning from earlier
turns) would make the trained tokens differ from the sampled ones, so they fail loudly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

HINT = ("Use a chat template that renders earlier messages identically whatever follows them "
        "(set actor.chat_template to such a Jinja template, e.g. plain ChatML), or keep "
        "rollout.max_turns=1.")


class TokenizationError(ValueError):
    pass


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    if not messages:
        # Templates differ on empty conversations; the generation prompt alone is what we need.
        text = tokenizer.apply_chat_template([{"role": "user", "content": ""}], **kwargs)
        return text[len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                                      **({"tools": tools} if tools else {}))):]
    return tokenizer.apply_chat_template(messages, **kwargs)


def encode(tokenizer, text: str) -> list[int]:
    # The template already holds every special token; never let the tokenizer add BOS/EOS.
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        # Lengths are checked against the run's context (rollout.max_total_length), row by row and
        # named (an over-long prompt's warning); transformers' anonymous "Token indices sequence
        # length is longer than the specified maximum" line measures against another limit.
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the conversation followed by the assistant generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, tools, add_generation_prompt=True))


def _check_prefix(prefix: list[int], full: list[int], what: str) -> None:
    if full[: len(prefix)] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), len(full))
        raise TokenizationError(
            f"the chat template does not tokenize increasingly: {what} changed the tokens of the "
            f"earlier conversation at position {at}. {HINT}")


def tokenize_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                      ) -> tuple[list[int], list[int]]:
    """ids and action_mask of a full conversation; assistant content and its end-of-turn token
    are actions, template/system/user/tool tokens are not."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = encode(tokenizer, render(tokenizer, messages[:i], tools, add_generation_prompt=True))
            _check_prefix(ids, head, f"the generation prompt before message {i}")
            mask += [0] * (len(head) - len(ids))
            ids = head
        full = encode(tokenizer, render(tokenizer, messages[: i + 1], tools))
        _check_prefix(ids, full, f"message {i} ({message['role']})")
        new = full[len(ids):]
        if message["role"] == "assistant":
            # Actions run through the end-of-turn token; what the template adds after it is not sampled.
            end = new.index(eos) + 1 if eos in new else len(new)
            mask += [1] * end + [0] * (len(new) - end)
        else:
            mask += [0] * len(new)
        ids = full
    return ids, mask


def continuation_ids(tokenizer, messages: list[dict], new_messages: list[dict],
                     tools: list[dict] | None = None, ended_with_eos: bool = True) -> list[int]:
    """Tokens to append after the model's sampled turn (the last message of `messages`) so that the
    sequence continues with `new_messages` and a fresh generation prompt."""
    before_text = render(tokenizer, messages, tools)
    after_text = render(tokenizer, messages + new_messages, tools, add_generation_prompt=True)
    if not after_text.startswith(before_text):
        raise TokenizationError(
            "the chat template does not render increasingly: appending "
            f"{[m['role'] for m in new_messages]} messages changed the text of the earlier turns. {HINT}")
    before, after = encode(tokenizer, before_text), encode(tokenizer, after_text)
    _check_prefix(before, after, f"appending {[m['role'] for m in new_messages]} messages")
    # What the template writes after the assistant content (e.g. "<|im_end|>\n"), minus the
    # end-of-turn token the model already sampled.
    content = messages[-1]["content"]
    head_text = render(tokenizer, messages[:-1], tools, add_generation_prompt=True)
    if before_text.startswith(head_text + content):
        tail = before_text[len(head_text) + len(content):]
    else:  # templates that rewrite the assistant turn (e.g. strip whitespace)
        tail = before_text[before_text.rfind(content) + len(content):]
    if ended_with_eos and tail.startswith(tokenizer.eos_token):
        tail = tail[len(tokenizer.eos_token):]
    return encode(tokenizer, tail) + after[len(before):]


# -- bounds: env messages before they are tokenized, prompts against the context --------------------

def _content_chars(message: dict) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: only text parts have characters to count
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def bound_messages(messages: list[dict], max_chars: int) -> tuple[list[dict], int, int]:
    """(messages with at most `max_chars` characters of content in all, earlier messages first;
    characters before; characters kept). Messages that are cut are copies: the env's objects are left
    as they are. Bounding before tokenization keeps a huge env reply from costing seconds of BPE."""
    before = sum(_content_chars(m) for m in messages)
    if before <= max_chars:
        return messages, before, before
    left, out = max_chars, []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": content[:left]}
            left -= len(message["content"])
        elif isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part = {**part, "text": part["text"][:left]}
                    left -= len(part["text"])
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, before, max_chars - left


@dataclass
class PromptLengthReport:
    """Templated prompt lengths of the rows checked against the context (`limit` tokens)."""
    limit: int
    checked: int = 0  # rows tokenized
    total: int = 0  # rows given
    too_long: list[tuple[str, int]] = field(default_factory=list)  # (where, tokens) of each prompt >= limit

    @property
    def all_too_long(self) -> bool:
        return self.checked > 0 and len(self.too_long) == self.checked


def prompt_too_long(n_tokens: int, limit: int) -> bool:
    """A prompt leaves no room to sample a single token: the rollout skips its row."""
    return n_tokens >= limit


def check_prompt_lengths(rows: list[dict], tokenizer, limit: int, max_rows: int | None,
                         prepare: Any = None) -> PromptLengthReport:
    """Template and tokenize the first `max_rows` rows of each source (every row when None) and list
    those whose prompt fills the context (`limit` tokens) or more. Bounded on purpose: the rollout
    checks every row it draws anyway (RolloutWorker), this only finds the problem before training.
    `prepare(messages, where)` -> (messages, images): a vision-language model's image parts as their
    placeholder text (train/datasets/vision.py), which raises ImageError for an image that cannot be used."""
    report = PromptLengthReport(limit, total=len(rows))
    seen: dict[Any, int] = {}
    for i, row in enumerate(rows):
        source = row.get("source")
        if max_rows is not None:
            if seen.get(source, 0) >= max_rows:
                continue
            seen[source] = seen.get(source, 0) + 1
        messages = row["messages"]
        if prepare is not None:
            messages = prepare(messages, getattr(row, "where", None) or f"row {i + 1}")[0]
        n = len(prompt_ids(tokenizer, messages, row.get("tools")))
        report.checked += 1
        if prompt_too_long(n, limit):
            report.too_long.append((getattr(row, "where", None) or f"row {i + 1}", n))
    return report
