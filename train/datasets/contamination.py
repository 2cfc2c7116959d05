"""Test prompts that also appear in the training data, exactly or nearly: checked at start-up.

A prompt's text is its messages' contents joined, lower-cased, with whitespace collapsed. A test
row is an exact duplicate when that text is a training prompt's; a near duplicate when it shares a
run of `n` words (13 by default, as in the GPT-3 / PaLM decontamination studies) with one. Prompts
shorter than `n` words are only checked exactly. Lines found in many training prompts of one source
(more than 1% of that source's rows, and more than 5) are shared boilerplate, a system prompt or a
task's instructions, and are left out of the n-grams: counted per source, so a small source's
instructions are boilerplate in a mixture with a large one (30 code rows beside 5,000 math rows).
Memory: one 64-bit hash per training prompt, per distinct (source, line) pair and per distinct
n-gram, so it grows with the training set's distinct text, never with the test set (each test row is
checked and dropped). A mixture's test rows are also counted by their source (against the training
prompts of every source).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field


def prompt_text(row: dict) -> str:
    return re.sub(r"\s+", " ", " ".join(_contents(row)).lower()).strip()


def ngrams(words: list[str], n: int) -> set[int]:
    return {hash(" ".join(words[i:i + n])) for i in range(len(words) - n + 1)}


@dataclass
class ContaminationReport:
    test_rows: int
    exact: list[int] = field(default_factory=list)  # test row numbers (0-based) with an identical train prompt
    near: list[int] = field(default_factory=list)  # test rows sharing an n-gram with a train prompt (not exact)
    examples: list[str] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # test source -> [exact, near, test rows]

    @property
    def found(self) -> bool:
        return bool(self.exact or self.near)

    def summary(self, n: int) -> str:
        shown = "; ".join(repr(e[:80]) for e in self.examples[:3])
        per_source = "; ".join(f"{name}: {exact} exact, {near} near of {rows}"
                               for name, (exact, near, rows) in sorted(self.by_source.items()))
        return (f"{len(self.exact)} of {self.test_rows} test prompts also appear in the training data and "
                f"{len(self.near)} more share a run of {n} words with a training prompt (e.g. {shown})"
                + (f"; by test source: {per_source}" if per_source else ""))


def boilerplate_limit(n_train: int) -> int:
    """A line in more training prompts than this is shared boilerplate (a system prompt, a task's
    instructions: "Put your complete program in a ```python code block."), not a leaked item."""
    return max(5, n_train // 100)


def prompt_lines(row: dict) -> list[str]:
    """The prompt's non-empty lines, normalised as in `prompt_text`."""
    return [line for line in (re.sub(r"\s+", " ", raw.lower()).strip()
                              for raw in "\n".join(_contents(row)).splitlines()) if line]


def _contents(row: dict) -> list[str]:
    parts = []
    for m in row.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts; an image counts as one word naming its source
            parts += [p.get("text", "") if p.get("type") == "text" else _image_word(p) for p in content
                      if isinstance(p, dict)]
    return parts


def _image_word(part: dict) -> str:
    """One word standing for an image part: the same image (path or data: URL) gives the same word, so two
    prompts with the same text over different pictures are different prompts."""
    source = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
    source = source.get("url") if isinstance(source, dict) else source
    return "image:" + hashlib.blake2b(str(source).encode(), digest_size=8).hexdigest()


def shared_lines(train_rows: list[dict]) -> set[int]:
    """Hashes of the boilerplate lines: those in more than `boilerplate_limit` training prompts of one
    source (rows without a `source` form one). Per source, because a mixture's small source would
    otherwise never reach 1% of all rows and its instructions would make every test row a near
    duplicate; a line copied into a few training prompts stays under the limit and is checked."""
    sizes: dict[object, int] = {}
    line_counts: dict[tuple[object, int], int] = {}
    for row in train_rows:
        source = row.get("source")
        sizes[source] = sizes.get(source, 0) + 1
        for h in {hash(line) for line in prompt_lines(row)}:
            line_counts[source, h] = line_counts.get((source, h), 0) + 1
    return {h for (source, h), count in line_counts.items() if count > boilerplate_limit(sizes[source])}


def check_contamination(train_rows: list[dict], test_rows: list[dict], n: int = 13) -> ContaminationReport:
    # Lines most training prompts share are left out of the n-grams: a test prompt sharing only its
    # instructions (and a few words around them) with a training prompt is not a leak.
    shared = shared_lines(train_rows)

    def content_words(row: dict) -> list[str]:
        return " ".join(line for line in prompt_lines(row) if hash(line) not in shared).split()

    exact_texts: set[int] = set()  # hashes, not the texts: memory per training prompt stays 8 bytes
    grams: set[int] = set()
    for row in train_rows:
        exact_texts.add(hash(prompt_text(row)))
        grams |= ngrams(content_words(row), n)
    report = ContaminationReport(len(test_rows))
    for i, row in enumerate(test_rows):
        text = prompt_text(row)
        counts = (report.by_source.setdefault(str(row["source"]), [0, 0, 0]) if row.get("source") is not None
                  else [0, 0, 0])
        counts[2] += 1
        if hash(text) in exact_texts:
            report.exact.append(i)
            counts[0] += 1
        elif grams and not grams.isdisjoint(ngrams(content_words(row), n)):
            report.near.append(i)
            counts[1] += 1
        else:
            continue
        report.examples.append(text)
    return report
