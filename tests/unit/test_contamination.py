"""The train/test contamination check on the shipped mixture (docs/data.md): shared instructions of a
small source are boilerplate, a copied problem is still a near duplicate (issue 33, item 8)."""
from __future__ import annotations

import copy

from conftest import compose_config
from test_docs import Command, commands, fenced_blocks
from train.datasets.contamination import check_contamination
from train.datasets.mixture import load_sources
from train.trainer.config import data_sources


def documented_mixture() -> tuple[list[dict], list[dict]]:
    """The training and test rows of docs/data.md's mixture command, loaded as the trainer loads them."""
    runs = [c for lang, lines in fenced_blocks("docs/data.md") if lang == "bash"
            for c in commands("docs/data.md", lines) if isinstance(c, Command)]
    [mixture] = [c for c in runs if any(w.startswith("data.test_data_path={") for w in c.words)]
    overrides = [w for w in mixture.words if w.startswith(("data.", "rollout."))]
    train_sources, test_sources = data_sources(compose_config(overrides).data)
    return load_sources(train_sources), load_sources(test_sources)


def test_the_documented_mixture_is_not_flagged(in_repo_root):
    """30 code rows beside 5,000 math rows: their shared instructions ("Complete the function below and
    put it in a ```python code block.") are in 15 rows, under 1% of the mixture, so every code test prompt
    used to be a near duplicate (13-word runs across the problem and the instructions)."""
    train, test = documented_mixture()
    assert {r["source"] for r in test} == {"math", "language", "code"}
    report = check_contamination(train, test)
    assert not report.found, report.summary(13)
    assert report.by_source["code"] == [0, 0, 10]


def test_a_problem_copied_into_the_mixture_s_training_set_is_still_caught(in_repo_root):
    train, test = documented_mixture()
    code_tests = [r for r in test if r["source"] == "code"]
    leaked = copy.deepcopy(next(r for r in train if r["source"] == "code"))
    problem = code_tests[3]["messages"][-1]["content"].split("\n\n")[0]  # the problem line, not the instructions
    instructions = leaked["messages"][-1]["content"].split("\n\n", 1)[1]
    leaked["messages"][-1]["content"] = "Warm-up. " + problem + "\n\n" + instructions
    exact = copy.deepcopy(code_tests[7])
    exact["source"] = "math"  # a test prompt copied whole into another source's training rows
    report = check_contamination(train + [leaked, exact], code_tests)
    assert report.exact == [7] and report.near == [3], report.summary(13)
    assert problem.lower() in report.examples[0]  # examples follow the test rows: 3 (near), then 7
