"""The data checks a run makes before training, in one place: the trainer (rank 0, at start-up) and the
pre-flight check (`python -m train.trainer.config --check`, on a bounded read) call the same functions.

* every row's source has an environment (rollout.env_path as a mapping; mixture.check_routes);
* the test set shares no long word run with the training set (contamination.py), an error under
  data.fail_on_contamination=true, else a warning;
* prompts that fill the context (`rollout.max_total_length`, default the model's
  max_position_embeddings): the first `data.check_rows` rows of each source are templated and
  tokenized; each such row is an error under data.overlong_prompts=fail, a counted warning under
  skip, and a data set whose checked prompts are all too long is an error either way (the run would
  skip every step). Rows past the checked ones are checked when the rollout draws them
  (RolloutWorker: finish reason `prompt_too_long`; the trainer warns or fails then, see
  PromptOverflowLog).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from train.datasets.config import DataConfig
from train.datasets.contamination import check_contamination
from train.datasets.errors import DataError
from train.datasets.mixture import check_routes
from train.datasets.tokenize import check_prompt_lengths
from train.datasets.vision import ImageError, refuse_images
from train.workers.rollout import UNUSABLE_PROMPTS, Sample


@dataclass(frozen=True)
class Context:
    """The conversation limit in tokens, and which setting made it (for messages)."""
    tokens: int
    key: str


def context_length(max_total_length: int | None, model_path: str) -> Context:
    """`rollout.max_total_length`, or the model's max_position_embeddings when it is null."""
    if max_total_length:
        n = int(max_total_length)
        return Context(n, f"rollout.max_total_length={n}")
    from transformers import AutoConfig

    n = int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 4096))
    return Context(n, f"the model's max_position_embeddings, {n}, as rollout.max_total_length is null")


def overlong_problem(where: str | None, tokens: int, context: Context | int) -> str:
    """What is wrong with one row whose prompt fills the context."""
    limit = context if isinstance(context, int) else context.tokens
    source = f" ({context.key})" if isinstance(context, Context) else ""
    return (f"{where or 'a row'}: the prompt is {tokens} tokens with its chat template, as long as the "
            f"{limit}-token context{source} or longer, so nothing can be sampled")


def overlong_error(where: str | None, tokens: int, context: Context | int) -> str:
    return (f"{overlong_problem(where, tokens, context)}; shorten or drop the row, raise rollout.max_total_length "
            f"(up to what the model was trained for), or skip such rows with a warning: data.overlong_prompts=skip")


def overlong_warning(where: str | None, tokens: int, context: Context | int) -> str:
    return f"{overlong_problem(where, tokens, context)}: the row is skipped (data.overlong_prompts=skip)"


@dataclass
class DataCheck:
    """What the checks found that does not stop the run: one warning line each, and the rows found
    with prompts that fill the context (the warning names them; the rollout skips them)."""
    warnings: list[str] = field(default_factory=list)
    overlong_rows: list[str] = field(default_factory=list)


def check_data(data: DataConfig, train_rows: list[dict], test_rows: list[dict], routes: Mapping[str, Any],
               tokenizer, context: Context, vision: Any = None) -> DataCheck:
    """Run every data check on the rows given (all of them in the trainer; the first data.check_rows
    of each source in --check). Raises DataError for what stops the run."""
    if routes:
        check_routes(train_rows, routes, "data.train_data_path")
        check_routes(test_rows, routes, "data.test_data_path")
    out = DataCheck()
    n = data.contamination_ngram
    contamination = check_contamination(train_rows, test_rows, n) if test_rows else None
    if contamination is not None and contamination.found:
        if data.fail_on_contamination:
            raise DataError(f"data.fail_on_contamination: {contamination.summary(n)}")
        out.warnings.append(f"{contamination.summary(n)}; test rewards overstate generalisation "
                            "(data.fail_on_contamination=true stops such runs)")
    for key, rows in (("data.train_data_path", train_rows), ("data.test_data_path", test_rows)):
        if rows:
            _prompt_lengths(data, key, rows, tokenizer, context, out, vision)
    return out


def _prompt_lengths(data: DataConfig, key: str, rows: list[dict], tokenizer, context: Context, out: DataCheck,
                    vision: Any = None) -> None:
    """`vision` (a vision-language model's VisionProcessor): image parts are checked too; a bad image stops
    the run with an error naming its file, row and message part."""
    prepare = vision.prepare if vision is not None else refuse_images
    try:
        report = check_prompt_lengths(rows, tokenizer, context.tokens, data.check_rows, prepare)
    except ImageError as e:
        raise DataError(f"{key}: {e}") from None
    if not report.too_long:
        return
    where, tokens = report.too_long[0]
    checked = (f"all {report.checked} prompts" if report.checked == report.total
               else f"the {report.checked} prompts checked (data.check_rows={data.check_rows} of each source)")
    if report.all_too_long:
        raise DataError(f"{key}: {checked} are as long as the {context.tokens}-token context ({context.key}) or "
                        f"longer, e.g. {where} ({tokens} tokens): the run would skip every step. Raise "
                        f"rollout.max_total_length (up to what the model was trained for) or shorten the prompts")
    if data.overlong_prompts == "fail":
        raise DataError(overlong_error(where, tokens, context))
    named = report.too_long[:NAMED]
    line = overlong_warning(where, tokens, context)
    if len(report.too_long) > 1:
        also = ", ".join(f"{w} ({n} tokens)" for w, n in named[1:])
        rest = len(report.too_long) - len(named)
        line += f"; so are {also}" + (f" and {rest} more" if rest else "") + f" of {checked}"
    out.warnings.append(line)
    out.overlong_rows += [w for w, _ in report.too_long]


NAMED = 5  # rows named in a warning; further ones are counted


class PromptOverflowLog:
    """Rows skipped at rollout time for prompts that fill the context, as warning lines: each row not
    named before (`known`: at start-up) is named, up to NAMED of them; then one line each time the
    number of skipped draws doubles, so a data set with many such rows does not flood the console
    (each draw is still a `prompt_too_long` event in trajectories.jsonl)."""

    def __init__(self, context: Context, known: list[str] = ()) -> None:
        self.context, self.known = context, set(known)
        self.named = self.skipped = 0
        self.next_count = 2 * NAMED

    def add(self, rows: list[dict]) -> list[str]:
        """Warning lines for this step's skipped rows (each a `prompt_too_long` event)."""
        lines = []
        for event in rows:
            self.skipped += 1
            where = event.get("row")
            if (where is not None and where in self.known) or self.named >= NAMED:
                continue
            self.named += 1
            if where is not None:
                self.known.add(where)
            context = self.context if event["limit"] == self.context.tokens else event["limit"]
            line = overlong_warning(where, event["tokens"], context)
            if self.named == NAMED:
                line += "; further such rows are counted here, not named (each is in trajectories.jsonl)"
            lines.append(line)
        if self.skipped >= self.next_count:
            lines.append(f"{self.skipped} draws of rows skipped so far for prompts that fill the context "
                         f"(prompt_overflow_ratio/train; a `prompt_too_long` event each in trajectories.jsonl)")
            while self.next_count <= self.skipped:
                self.next_count *= 2
        return lines


def overflowed_rows(samples: list[Sample], group_size: int) -> list[dict]:
    """The event of each skipped row (its group's first sample): `prompt_too_long` (row, tokens, limit) or
    `bad_image` (row, error)."""
    return [dict(s.events[0]) for s in samples[::group_size] if s.finish_reason in UNUSABLE_PROMPTS]
