"""Test prompts that also appear in the training data, exactly or nearly: checked at start-up.

A prompt's text is its messages' contents joined, lower-cased, with whitespace collapsed. A test
row is an exact duplicate when that text is a training prompt's; a near duplicate when it shares a
run of `n` words (13 by default, as in the GPT-3 / PaLM decontamination studies) with one. Prompts
shorter than `n` words are only checked exactly. Memory: one hash per distinct training n-gram.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field


def prompt_text(row: dict) -> str:
    parts = []
    for m in row.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts
            parts += [p.get("text", "") for p in content if isinstance(p, dict)]
    return re.sub(r"\s+", " ", " ".join(parts).lower()).strip()


def ngrams(words: list[str], n: int) -> set[int]:
    return {hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}


@dataclass
class ContaminationReport:
    test_rows: int
    exact: list[int] = field(default_factory=list)  # test row numbers (0-based) with an identical train prompt
    near: list[int] = field(default_factory=list)  # test rows sharing an n-gram with a train prompt (not exact)
    examples: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.exact or self.near)

    def summary(self, n: int) -> str:
        shown = "; ".join(repr(e[:80]) for e in self.examples[:3])
        return (f"{len(self.exact)} of {self.test_rows} test prompts also appear in the training data and "
                f"{len(self.near)} more share a run of {n} words with a training prompt (e.g. {shown})")


def check_contamination(train_rows: list[dict], test_rows: list[dict], n: int = 13) -> ContaminationReport:
    exact_texts: set[str] = set()
    grams: set[int] = set()
    for row in train_rows:
        text = prompt_text(row)
        exact_texts.add(text)
        grams |= ngrams(text.split(), n)
    report = ContaminationReport(len(test_rows))
    for i, row in enumerate(test_rows):
        text = prompt_text(row)
        if text in exact_texts:
            report.exact.append(i)
        elif grams and not grams.isdisjoint(ngrams(text.split(), n)):
            report.near.append(i)
        else:
            continue
        report.examples.append(text)
    return report
