#!/usr/bin/env python
"""Write the stub search corpus and its QA rows (deterministic: re-running gives the same bytes).

    .venv/bin/python stub/data/search/build.py

corpus.jsonl  {"id": "d000", "title": ..., "text": ...}: short passages about an invented world,
              so a question can only be answered from the corpus, never from memory.
train.jsonl / test.jsonl
              {"messages": [system, user], "answer": {"target": ..., "gold_ids": [...]}}: the
              answer is stated in the gold document(s). searchr1.py scores `target` by exact
              match; judge_ndcg.py also ranks the retrieved ids against `gold_ids`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 5

# Short on purpose: the bundled tiny model has 512 positions for prompt, search results and replies.
SYSTEM_PROMPT = ("Answer the question. To look it up, write <search>query</search>. "
                 "Give the final answer as <answer>...</answer>.")

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
CODAS = ["", "n", "r", "l", "s", "th", "nd", "rk"]


def name(rng: random.Random, used: set[str], syllables: int = 2) -> str:
    while True:
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(CODAS)
        word = word.capitalize()
        if word not in used:
            used.add(word)
            return word


def build() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    used: set[str] = set()
    docs: list[dict] = []
    qa: list[dict] = []

    def doc(title: str, text: str) -> str:
        did = f"d{len(docs):03d}"
        docs.append({"id": did, "title": title, "text": text})
        return did

    def ask(question: str, target: str, gold: list[str]) -> None:
        qa.append({"question": question, "target": target, "gold_ids": gold})

    things = ["lantern", "loom", "compass", "kettle", "telescope", "bell", "clock", "barometer", "press", "sextant"]
    animals = ["heron", "lynx", "otter", "falcon", "ibex", "marten", "crane", "badger"]
    for i in range(12):
        country, capital, river, lake = (name(rng, used) for _ in range(4))
        inventor = f"{name(rng, used)} {name(rng, used)}"
        thing, animal = things[i % len(things)], animals[i % len(animals)]
        year, height = str(rng.randint(1700, 1950)), str(rng.randint(1200, 8800))
        mountain = name(rng, used)
        d_cap = doc(country, f"{country} is a small country. Its capital is {capital}.")
        d_riv = doc(f"{river} River", f"The {river} River flows through {capital} into Lake {lake}.")
        d_inv = doc(inventor, f"{inventor} of {country} built the first {thing} in {year}.")
        d_mtn = doc(f"Mount {mountain}", f"Mount {mountain} in {country} is {height} metres high.")
        d_ani = doc(f"Fauna of {country}", f"The national animal of {country} is the {animal}.")
        ask(f"What is the capital of {country}?", capital, [d_cap])
        ask(f"Into which lake does the {river} River flow?", f"Lake {lake}", [d_riv])
        ask(f"Who built the first {thing} in {country}?", inventor, [d_inv])
        ask(f"How high is Mount {mountain} in metres?", height, [d_mtn])
        ask(f"What is the national animal of {country}?", animal, [d_ani])
        # two hops: the river passage names the capital, the capital passage names the country
        ask(f"Which river flows through the capital of {country}?", f"{river} River", [d_cap, d_riv])
    rows = [{"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q["question"]}],
             "answer": {"target": q["target"], "gold_ids": q["gold_ids"]}} for q in qa]
    rng.shuffle(rows)
    return docs, rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def main() -> None:
    docs, rows = build()
    n_test = len(rows) // 6
    write_jsonl(HERE / "corpus.jsonl", docs)
    write_jsonl(HERE / "train.jsonl", rows[n_test:])
    write_jsonl(HERE / "test.jsonl", rows[:n_test])
    print(f"{len(docs)} documents, {len(rows) - n_test} train and {n_test} test questions in {HERE}")


if __name__ == "__main__":
    main()
