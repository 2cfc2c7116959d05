"""What to roll out next: per-prompt pass-rate statistics and the sampling policies that use them
(`data.curriculum.*`).

Every prompt has a stable id (its row's `id`, else a hash of its messages and answer). After each
step the trainer records, for every group of every rank, the share of its responses whose reward
reached `pass_threshold`, and keeps per prompt the number of visits, an exponential moving average
of that pass rate and the last step it was seen. The statistics are global (every rank holds the
same, from one small all-gather per step), so every rank takes the same sampling decisions.

Policies decide, as the data loader walks its epoch permutation, whether a candidate prompt is rolled
out (`accept`); the epoch structure, the loader's resumable position and the order are unchanged:

- `uniform`: every prompt (the default; nothing is recorded unless asked for);
- `skip_saturated`: a prompt seen at least `min_visits` times whose EMA pass rate is <= `low` (never
  solved) or >= `high` (always solved) is skipped, except with probability `recheck` per epoch, so it
  can come back once the policy changes;
- `prioritized`: a prompt is taken with probability w / w_max, w = p (1 - p) + `floor` (learning
  progress is largest at p = 1/2); an unseen prompt has the largest weight.

Random draws come from a hash of (seed, epoch, position), not from a generator: the same on every
rank and after a resume. No prompt becomes unreachable: `recheck` and `floor` must be > 0, and a
batch that would skip a whole epoch's worth of candidates takes the rest as they come.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass

from train.datasets.config import POLICIES, CurriculumConfig


def prompt_id(row: dict) -> str:
    """The row's `id` if it has one, else a hash of its messages and answer (and source, in a mixture:
    the same prompt in two sources is two prompts), stable across runs."""
    if row.get("id") is not None:
        return str(row["id"]) if row.get("source") is None else f"{row['source']}/{row['id']}"
    key = {"messages": row.get("messages"), "answer": row.get("answer")}
    if row.get("source") is not None:
        key["source"] = str(row["source"])
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def unit_draw(seed: int, epoch: int, position: int) -> float:
    """A uniform number in [0, 1) from (seed, epoch, position), identical on every rank."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass
class PromptStat:
    visits: int = 0
    ema: float = 0.0  # EMA of the group pass rate (the first visit sets it)
    last_step: int = 0


class PromptStats:
    """Per-prompt visits, EMA pass rate and last step; the same on every rank."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.stats: dict[str, PromptStat] = {}

    def update(self, step: int, pass_rates: list[tuple[str, float]]) -> None:
        """Record one step's groups (every rank's, in rank order): (prompt id, pass rate)."""
        for pid, rate in pass_rates:
            s = self.stats.setdefault(pid, PromptStat())
            s.ema = rate if s.visits == 0 else self.decay * s.ema + (1 - self.decay) * rate
            s.visits += 1
            s.last_step = step

    def get(self, pid: str) -> PromptStat | None:
        return self.stats.get(pid)

    def state_dict(self) -> dict:
        return {pid: asdict(s) for pid, s in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {pid: PromptStat(**s) for pid, s in state.items()}

    def dump(self, path: str) -> None:
        """prompt_stats.jsonl: one line per prompt seen, for inspection (atomic)."""
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            for pid, s in sorted(self.stats.items()):
                f.write(json.dumps({"id": pid, **asdict(s)}) + "\n")
        os.replace(tmp, path)


class Curriculum:
    """A policy's `accept(row index, epoch, position)` for the data loader, and its counters."""

    def __init__(self, cfg: CurriculumConfig, rows: list[dict], seed: int) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown curriculum policy {cfg.policy!r}; choose one of {', '.join(POLICIES)}")
        self.cfg, self.seed, self.rows = cfg, seed, rows
        self._ids: dict[int, str] = {}  # row index -> prompt id, computed when first needed
        self.stats = PromptStats(cfg.ema_decay)
        self.skipped = 0  # candidates passed over since the last `take_counters`
        self._summary: list = [0, 0.0, 0, 0]  # prompts seen, EMA sum, never solved, always solved

    def id_of(self, index: int) -> str:
        if index not in self._ids:
            self._ids[index] = prompt_id(self.rows[index])
        return self._ids[index]

    def saturated(self, s: PromptStat | None) -> bool:
        c = self.cfg
        return s is not None and s.visits >= c.min_visits and (s.ema <= c.low or s.ema >= c.high)

    def weight(self, s: PromptStat | None) -> float:
        p = 0.5 if s is None else s.ema  # unseen: the largest weight
        return p * (1 - p) + self.cfg.floor

    def accept(self, index: int, epoch: int, position: int) -> bool:
        c = self.cfg
        if c.policy == "uniform":
            return True
        s = self.stats.get(self.id_of(index))
        if c.policy == "skip_saturated":
            ok = not self.saturated(s) or unit_draw(self.seed, epoch, position) < c.recheck
        else:
            ok = unit_draw(self.seed, epoch, position) < self.weight(s) / (0.25 + c.floor)
        self.skipped += not ok
        return ok

    def record(self, step: int, pass_rates: list[tuple[str, float]]) -> None:
        """One step's groups into the statistics, keeping the pass-rate summary current: only the
        prompts of this step are touched (not every prompt seen, which a large dataset makes slow)."""
        touched = dict.fromkeys(pid for pid, _ in pass_rates)  # a prompt may come twice in one step
        for pid in touched:
            self._count(self.stats.get(pid), -1)
        self.stats.update(step, pass_rates)
        for pid in touched:
            self._count(self.stats.get(pid), +1)

    def state_dict(self) -> dict:
        # The running summary travels too: recounting it would round differently from the straight run.
        return {"stats": self.stats.state_dict(), "summary": list(self._summary)}

    def load_state_dict(self, state: dict) -> None:
        self.stats.load_state_dict(state["stats"])
        self._summary = list(state["summary"])

    def _count(self, s: PromptStat | None, sign: int) -> None:
        """Add (or remove) one prompt's share of the summary: [prompts, EMA sum, never, always]."""
        if s is None:
            return
        summary = self._summary
        summary[0] += sign
        summary[1] += sign * s.ema
        summary[2] += sign * (s.ema <= self.cfg.low)
        summary[3] += sign * (s.ema >= self.cfg.high)

    def take_counters(self) -> dict[str, float]:
        """Metrics since the last call: candidates skipped, and the pass-rate picture of the prompts seen."""
        seen, ema_sum, never, always = self._summary
        out = {"curriculum/skipped": float(self.skipped), "curriculum/prompts_seen": float(seen)}
        self.skipped = 0
        if seen:
            out["curriculum/pass_rate_mean"] = ema_sum / seen
            out["curriculum/never_solved"] = never / seen
            out["curriculum/always_solved"] = always / seen
        return out
