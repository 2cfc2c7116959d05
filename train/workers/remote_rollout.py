"""A trainer rank's side of a dedicated rollout rank (`rollout.ranks=K`, train/parallel/rollout_bridge.py).

`RemoteEngine` and `RemoteRollout` stand where the in-process engine and `RolloutWorker` stand, with
the same methods the trainer calls, so the step loop, the asynchronous prefetch, the weight push and
its verification, evaluation and checkpoints run unchanged:

- a rollout request (the rows, the sampling parameters, the seed, the weight version) goes to the
  rollout rank, which generates and scores it (with the requests of the other trainer ranks it
  serves, in one engine batch) and sends the samples back;
- a weight push: every trainer rank announces it; trainer rank 0 broadcasts the full tensors to the
  rollout ranks in flat byte buckets of `rollout.bucket_size_mb` (one broadcast per bucket), while
  the others take part in gathering them (FSDP), as for an in-process engine;
- `weight_checksums` asks the rollout rank for the checksums of what it holds (`trainer.verify_push`),
  `score` for its engine's log-probs of the sync probe (`trainer.sync_probe_every`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from train.engines.base import SamplingParams
from train.engines.weight_buckets import iter_buckets
from train.parallel.rollout_bridge import Bridge
from train.workers.rollout import Sample


class RemoteEngine:
    """The trainer's handle on the engine of its rollout rank."""

    def __init__(self, bridge: Bridge, trainer_rank: int, bucket_bytes: int) -> None:
        self.bridge, self.rank, self.bucket_bytes = bridge, trainer_rank, bucket_bytes
        self.server = bridge.split.server_of(trainer_rank)
        self.stats: dict[str, float] = {"generated_tokens": 0.0, "generation_seconds": 0.0}
        self.weight_version = 0  # sent with every request; the rollout rank tags its samples with it
        self.dtype: torch.dtype = torch.float32  # the rollout rank's, learned at set-up
        self.step = 0  # the trainer's step in progress (set by the trainer): names a push in an error
        self._buckets = 0  # buckets in the last push (the same every push): "bucket 2 of 5"

    def request(self, message: dict, request: str, reply: str) -> dict:
        """Send `message` (`request` names it in an error), wait for the reply (`reply` names it); an
        error on the rollout rank comes back as one and is raised here."""
        self.bridge.send(message, self.server, request)
        answer = self.bridge.recv(self.server, reply)
        if "error" in answer:
            raise RuntimeError(f"rollout rank {self.server}: {answer['error']}")
        return answer

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every trainer rank announces the push and gathers; trainer rank 0 broadcasts the buckets."""
        push = f"step {self.step}'s weight push"
        self.bridge.send({"kind": "weights", "step": self.step}, self.server, f"the request for {push}")
        if self.rank != 0:
            for _ in named_tensors:  # the full tensors are gathered collectively: take part, send nothing
                pass
            return
        of = f" of {self._buckets}" if self._buckets else ""
        i = 0
        for i, bucket in enumerate(iter_buckets(named_tensors, self.bucket_bytes), 1):
            meta = [(name, tuple(t.shape)) for name, t in bucket.named_tensors]
            what = f"{push}, bucket {i}{of} ({bucket.nbytes} bytes)"
            self.bridge.broadcast_object({"dtype": bucket.dtype, "tensors": meta}, f"the layout of {what}")
            # laid end to end where the tensors are (one kernel on a GPU), then one copy to the host for gloo
            flat = torch.cat([t.detach().reshape(-1) for _, t in bucket.named_tensors]).to("cpu")
            self.bridge.broadcast(flat.view(torch.uint8), what)
        self._buckets = i
        self.bridge.broadcast_object({"end": True}, f"the end of {push}")

    def weight_checksums(self, names: Iterable[str]) -> dict[str, int]:
        return self.request({"kind": "checksums", "names": list(names)}, f"the checksum request of step {self.step}",
                            f"the checksums of step {self.step}'s weight push")["checksums"]

    def score(self, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """The rollout rank's engine's log-probs of `token_ids` (the sync probe)."""
        return self.request({"kind": "score", "ids": list(token_ids), "temperature": temperature},
                            f"the sync probe of step {self.step}",
                            f"the engine's log-probs of step {self.step}'s sync probe")["logprobs"]

    def wake(self) -> None:  # the rollout rank's engine keeps its memory: it never trains
        pass

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass


class RemoteRollout:
    """`RolloutWorker`'s methods, served by the rollout rank."""

    def __init__(self, engine: RemoteEngine, setup: dict) -> None:
        self.engine = engine
        self._calls: list[dict] = []
        self._stuck = 0
        self.arrived_scores: dict[tuple[int, int], tuple[float, str | None]] = {}  # rewards sent with segments
        reply = engine.request({"kind": "hello", **setup}, "the set-up request",
                               "the rollout rank to load its engine and environment")
        engine.dtype = reply["dtype"]

    def rollout(self, rows: list[dict], responses_per_prompt: int, sampling: SamplingParams,
                base_seed: int, what: str = "a rollout", on_generated=None) -> tuple[list[Sample], float]:
        """(The rollout rank answers when its rewards are in: `on_generated` is called then.)"""
        reply = self.engine.request(
            {"kind": "rollout", "what": what, "rows": rows, "n": responses_per_prompt, "sampling": sampling,
             "seed": base_seed, "version": self.engine.weight_version},
            f"the request for {what}", f"the samples of {what}")
        self._took(reply)
        if on_generated is not None:
            on_generated()
        return reply["samples"], reply["seconds"]

    def advance(self, groups: list, sampling: SamplingParams, budget: int, what: str = "a segment",
                on_generated=None, defer_env: bool = False) -> tuple[list, float]:
        """One in-flight segment of `groups` (rollout.inflight) on the rollout rank: they travel there and back
        (tokens, versions, log-probs, conversations); the groups as they came back and the wall time."""
        reply = self.engine.request(
            {"kind": "advance", "what": what, "groups": groups, "sampling": sampling, "budget": budget,
             "defer_env": defer_env, "version": self.engine.weight_version},
            f"the request for {what}", f"the groups of {what}")
        self._took(reply)
        self.arrived_scores.update(reply.get("scores", {}))
        if on_generated is not None:
            on_generated()
        return reply["groups"], reply["seconds"]

    def finished_scores(self) -> dict[tuple[int, int], tuple[float, str | None]]:
        """Rewards the rollout rank sent with the last segments (each handed out once)."""
        out, self.arrived_scores = self.arrived_scores, {}
        return out

    def scores(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, str | None]]:
        """The rewards the rollout rank computed (or is computing) for samples of earlier segments."""
        return self.engine.request({"kind": "scores", "keys": list(keys)}, "the request for the rewards of "
                                   f"{len(keys)} samples", f"the rewards of {len(keys)} samples")["scores"]

    def _took(self, reply: dict) -> None:
        self.engine.stats["generated_tokens"] += reply["tokens"]
        self.engine.stats["generation_seconds"] += reply["engine_seconds"]
        self._calls += reply["api_calls"]
        self._stuck = reply["stuck_calls"]

    def pop_api_calls(self) -> list[dict]:
        calls, self._calls = self._calls, []
        return calls

    @property
    def stuck_calls(self) -> int:
        return self._stuck

    def close(self) -> None:
        """Tell the rollout rank the run is over (it then exits); not over a failed bridge (its
        error is already raised; the rollout rank finds its trainer ranks gone)."""
        if self.engine.bridge.failed is None:
            self.engine.bridge.send({"kind": "stop"}, self.engine.server, "the stop request")
