"""Rubrics: a reward made of named, weighted criteria, each scored on its own.

An env module builds one and uses it as its `reward_fn`:

    from train.workers.rubric import Criterion, Rubric, regex

    RUBRIC = Rubric([
        regex("format", r"<answer>.*</answer>", weight=0.2),          # a format check on the last reply
        Criterion("correct", lambda messages, answer, state: float(extract(messages) == answer)),
        Criterion("judged", ask_judge, weight=0.5, timeout_s=60),      # async: an LLM judge, a sandbox test
    ])
    reward_fn = RUBRIC.reward_fn

A criterion is a function of (messages, answer, state) returning a number in [0, 1] (sync or async; `state` is a
dict the criteria of one conversation share: a parsed answer, a sandbox verdict). The reward is the weighted mean
of the criteria. A criterion that raises or runs past its timeout scores 0 and its error is kept
(`RubricScore.errors`), so one broken check costs that criterion, never the sample or the run. The trainer logs
each criterion's mean as `rubric/<name>` (and `rubric/<name>/<source>` with several data sources). Scores are
cached per conversation (messages and answer), so scoring a conversation twice runs its checks once.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable


class RubricScore(float):
    """A reward (the weighted mean) that also carries each criterion's score and the errors of those that failed."""
    criteria: dict[str, float]
    errors: dict[str, str]

    def __new__(cls, value: float, criteria: dict[str, float] | None = None,
                errors: dict[str, str] | None = None) -> "RubricScore":
        out = super().__new__(cls, value)
        out.criteria, out.errors = dict(criteria or {}), dict(errors or {})
        return out

    def __reduce__(self):  # pickles (a rollout rank's reply) with its criteria
        return RubricScore, (float(self), self.criteria, self.errors)


@dataclass(frozen=True)
class Criterion:
    name: str
    score: Callable[..., Any]  # (messages, answer, state) -> float in [0, 1], sync or async
    weight: float = 1.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"rubric criterion name {self.name!r}: use letters, digits, _ . - (it names a metric)")
        if not (self.weight >= 0 and math.isfinite(self.weight)):
            raise ValueError(f"rubric criterion {self.name!r}: weight must be finite and >= 0, got {self.weight}")


def regex(name: str, pattern: str, weight: float = 1.0, flags: int = re.DOTALL) -> Criterion:
    """1 when the last assistant message matches `pattern` (re.search), else 0."""
    compiled = re.compile(pattern, flags)

    def check(messages: list[dict], answer: Any, state: dict) -> float:
        reply = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        return float(bool(compiled.search(reply if isinstance(reply, str) else "")))
    return Criterion(name, check, weight)


@dataclass
class Rubric:
    criteria: list[Criterion]
    cache_size: int = 4096  # conversations whose scores are kept
    _cache: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.criteria]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a rubric needs criteria with distinct names, got {names}")
        if sum(c.weight for c in self.criteria) <= 0:
            raise ValueError("a rubric's weights must not all be 0")

    async def score(self, messages: list[dict], answer: Any, state: dict | None = None) -> RubricScore:
        key = _key(messages, answer)
        if key is not None and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        state = {} if state is None else state
        results = await asyncio.gather(*(self._one(c, messages, answer, state) for c in self.criteria))
        scores = {c.name: s for c, (s, _) in zip(self.criteria, results)}
        errors = {c.name: e for c, (_, e) in zip(self.criteria, results) if e is not None}
        total = sum(c.weight for c in self.criteria)
        out = RubricScore(sum(c.weight * scores[c.name] for c in self.criteria) / total, scores, errors)
        if key is not None:
            self._cache[key] = out
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out

    async def reward_fn(self, messages: list[dict], answer: Any) -> RubricScore:
        """The env module's `reward_fn`."""
        return await self.score(messages, answer)

    @staticmethod
    async def _one(c: Criterion, messages: list[dict], answer: Any, state: dict) -> tuple[float, str | None]:
        try:
            if inspect.iscoroutinefunction(c.score):
                value = await asyncio.wait_for(c.score(messages, answer, state), c.timeout_s)
            else:  # a thread, so a slow check does not hold the event loop (nor the other criteria)
                value = await asyncio.wait_for(asyncio.to_thread(c.score, messages, answer, state), c.timeout_s)
            value = float(value)
        except asyncio.TimeoutError:
            return 0.0, f"timed out after {c.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - a broken criterion scores 0, the sample and the run go on
            return 0.0, f"{type(e).__name__}: {e}"
        if not (0.0 <= value <= 1.0):
            return 0.0, f"scored {value!r}, outside [0, 1]"
        return value, None


def _key(messages: list[dict], answer: Any) -> str | None:
    try:
        return json.dumps([messages, answer], sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None
