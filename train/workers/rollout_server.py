"""A dedicated rollout rank's life (`rollout.ranks=K`): load the engine and the environments, then serve
the trainer ranks assigned to it until they say stop (train/parallel/rollout_bridge.py for the
groups, train/workers/remote_rollout.py for the trainer's side).

Each request comes from every trainer rank this rank serves, in the same order on all of them (the
trainer's step loop is the same on every rank): rollouts of several trainer ranks run together, in
one engine batch; a weight push is received once, from trainer rank 0's broadcast. Waiting for the
next request gives up after `rollout.async_timeout_s`, naming the last request served. A few times a
second the rank publishes what it is doing and the env call in flight the longest (`StatusBeacon`),
so a trainer rank that times out waiting for it can say where it was, or that it stopped answering.
"""
from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable, Iterator

import torch
from transformers import AutoTokenizer

from train.engines import build_engine
from train.parallel.distributed import DistContext, set_cpu_threads
from train.parallel.rollout_bridge import STATUS_EVERY_S, Bridge
from train.utils import hub
from train.workers.config import RolloutConfig
from train.workers.env_routing import EnvRouter, env_paths
from train.workers.rollout import RolloutWorker


def received_weights(bridge: Bridge, push: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one push (`push` names it, e.g. "step 3's weight push"), bucket by bucket, as
    trainer rank 0 broadcasts them."""
    i = 1
    while True:
        meta = bridge.broadcast_object(None, f"the layout of {push}, bucket {i} (or its end)")
        if meta.get("end"):
            return
        dtype, tensors = meta["dtype"], meta["tensors"]
        sizes = [int(torch.Size(shape).numel()) for _, shape in tensors]
        flat = torch.empty(sum(sizes), dtype=dtype)
        bridge.broadcast(flat.view(torch.uint8), f"{push}, bucket {i} ({flat.numel() * flat.element_size()} bytes)")
        for (name, shape), part in zip(tensors, flat.split(sizes)):
            yield name, part.view(shape)
        i += 1


class StatusBeacon:
    """Publishes this rollout rank's status from a daemon thread, every `every_s` and at once when
    its `phase` (what it is doing, set by the server) changes: the phase and the env call in flight
    the longest (`longest_call`). One small store write per beat; a trainer rank reads it only when
    a wait on its rollout rank times out."""

    def __init__(self, bridge: Bridge, every_s: float = STATUS_EVERY_S) -> None:
        self.bridge, self.every_s = bridge, every_s
        self._phase = "starting"
        self.longest_call: Callable[[], str] | None = None
        self._stop, self._changed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._beat, name="rollout-status", daemon=True)
        self._thread.start()

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self._changed.set()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._changed.clear()
            call = ""
            try:
                call = self.longest_call() if self.longest_call is not None else ""
            except RuntimeError:  # the env's table of calls changed while read: the next beat reads it
                pass
            try:
                self.bridge.publish_status({"phase": self._phase, "call": call})
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return
            self._changed.wait(self.every_s)

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        # Joined, so no store call is still in flight in C++ while the interpreter exits (a write
        # gives up after the status store's own short timeout).
        self._thread.join(timeout=10.0)


def local_folder(folder: str, name: str, kind: str) -> str:
    """The trainer rank's folder for a model, or (on another node, where that folder may not exist)
    the model's name resolved on this one (a Hub id is fetched into this node's cache)."""
    return folder if os.path.isdir(folder) else hub.resolve(name, kind)


class RolloutServer:
    def __init__(self, settings: RolloutConfig, ctx: DistContext, *, chat_template: str | None, seed: int,
                 num_threads: int | None) -> None:
        self.settings, self.ctx, self.bridge = settings, ctx, ctx.bridge
        self.chat_template, self.seed, self.num_threads = chat_template, seed, num_threads
        self.clients = ctx.split.clients_of(ctx.rank)
        self.timeout_s = float(settings.async_timeout_s)
        self.worker: RolloutWorker | None = None
        # in-flight group uid -> [the index (in `clients`) of the trainer rank it is of, rewards not handed out yet]
        self.owners: dict[int, list[int]] = {}
        self.status = StatusBeacon(self.bridge)

    def receive(self, after: str) -> list[dict]:
        """The next request from every trainer rank served (the same kind from each)."""
        self.status.phase = f"waiting for the next request after {after}"
        requests = [self.bridge.recv(c, f"the next request after {after}", self.timeout_s) for c in self.clients]
        kinds = [r["kind"] for r in requests]
        if len(set(kinds)) != 1:
            raise RuntimeError(f"rollout rank {self.ctx.rank}: trainer ranks {self.clients} sent different requests "
                               f"{kinds} (their step loops diverged)")
        return requests

    def reply(self, replies: list[dict], what: str) -> None:
        self.status.phase = f"sending {what}"
        for client, message in zip(self.clients, replies):
            self.bridge.send(message, client, what)

    def setup(self, hello: dict) -> None:
        settings = self.settings
        set_cpu_threads(self.ctx, self.num_threads)
        model_dir, tokenizer_dir = (local_folder(hello[key], hello[f"{key}_name"], kind)
                                    for key, kind in (("model", "model"), ("tokenizer", "tokenizer")))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if self.chat_template:
            tokenizer.chat_template = self.chat_template
        env = EnvRouter(env_paths(settings), timeout_s=settings.env_timeout_s, max_workers=settings.env_workers,
                        max_turns=settings.max_turns)
        self.status.longest_call = env.longest_call
        engine = build_engine(settings, self.ctx, model_path=model_dir, tokenizer=tokenizer, seed=self.seed,
                              record_routing=bool(hello.get("record_routing")))
        self.worker = RolloutWorker(engine, env, tokenizer, max_turns=settings.max_turns,
                                    env_error_reward=settings.env_error_reward,
                                    max_total_length=hello["max_total_length"], max_env_chars=settings.max_env_chars)

    def rollout(self, requests: list[dict]) -> list[dict]:
        engine = self.worker.engine
        engine.weight_version = requests[0]["version"]
        before = float(engine.stats["generation_seconds"])
        outs, seconds = self.worker.rollout_many([(r["rows"], r["n"], r["sampling"], r["seed"]) for r in requests])
        engine_seconds = float(engine.stats["generation_seconds"]) - before
        return [{"samples": samples, "seconds": seconds, "engine_seconds": engine_seconds,
                 "tokens": float(sum(sum(s.turn_lengths) for s in samples)), **env}
                for samples, env in zip(outs, self.env_reports(len(requests)))]

    def advance(self, requests: list[dict]) -> list[dict]:
        """One in-flight segment of every trainer rank's groups, in one engine batch; each gets its own back."""
        engine = self.worker.engine
        engine.weight_version = requests[0]["version"]
        before = (float(engine.stats["generated_tokens"]), float(engine.stats["generation_seconds"]))
        every = [g for r in requests for g in r["groups"]]
        for i, r in enumerate(requests):  # whose groups they are: rewards that come in later go back to them
            for g in r["groups"]:
                self.owners.setdefault(g.uid, [i, len(g.seeds)])
        _, seconds = self.worker.advance(every, requests[0]["sampling"], requests[0]["budget"], requests[0]["what"],
                                         defer_env=bool(requests[0].get("defer_env")))
        scores: list[dict] = [{} for _ in requests]
        for key, value in self.worker.finished_scores().items():
            owner = self.owners.get(key[0], [0, 1])  # (a requeued sample's old reward: its trainer rank ignores it)
            scores[owner[0]][key] = value
            owner[1] -= 1
            if owner[1] <= 0:  # every sample's reward handed out: forget the group
                self.owners.pop(key[0], None)
        tokens = float(engine.stats["generated_tokens"]) - before[0]
        engine_seconds = float(engine.stats["generation_seconds"]) - before[1]
        # the tokens are reported to the first trainer rank only (the trainer sums tokens over its ranks and
        # averages the seconds, as for `rollout`)
        return [{"groups": r["groups"], "scores": scores[i], "seconds": seconds, "engine_seconds": engine_seconds,
                 "tokens": tokens if i == 0 else 0.0, **env}
                for i, (r, env) in enumerate(zip(requests, self.env_reports(len(requests))))]

    def env_reports(self, count: int) -> list[dict]:
        """Per trainer rank served, the env's external calls and stuck threads since the last report: the shared
        environment's, reported once, to the first trainer rank."""
        calls, stuck = self.worker.pop_api_calls(), self.worker.stuck_calls
        return [{"api_calls": calls if i == 0 else [], "stuck_calls": stuck if i == 0 else 0} for i in range(count)]

    def serve(self) -> None:
        requests = self.receive("start-up (the trainer ranks' set-up)")
        if requests[0]["kind"] != "hello":
            raise RuntimeError(f"rollout rank {self.ctx.rank}: the first request was {requests[0]['kind']!r}, not hello")
        self.status.phase = "loading its engine and environment"
        try:
            self.setup(requests[0])
        except Exception as e:  # the trainer ranks say it, naming this rank
            self.reply([{"error": f"{type(e).__name__}: {e}"}] * len(self.clients), "the set-up's error")
            raise
        self.reply([{"dtype": self.worker.engine.dtype}] * len(self.clients), "the set-up's answer")
        last = "set-up"
        while True:
            requests = self.receive(last)
            kind = requests[0]["kind"]
            if kind == "stop":
                return
            if kind == "weights":  # the version comes with the next rollout request
                last = f"step {requests[0].get('step', '?')}'s weight push"
                self.status.phase = f"taking in {last}"
                self.worker.engine.update_weights(received_weights(self.bridge, last))
                continue
            try:
                if kind == "rollout":
                    last = requests[0]["what"]
                    self.status.phase = f"serving {last}"
                    replies = self.rollout(requests)
                    answer = f"the samples of {last}"
                elif kind == "advance":
                    last = requests[0]["what"]
                    self.status.phase = f"serving {last}"
                    replies = self.advance(requests)
                    answer = f"the groups of {last}"
                elif kind == "scores":
                    last = "a request for rewards"
                    self.status.phase = "computing the rewards of samples generated earlier"
                    every = self.worker.scores([key for r in requests for key in r["keys"]])
                    replies = [{"scores": {key: every[key] for key in r["keys"] if key in every}} for r in requests]
                    answer = "the rewards"
                elif kind == "checksums":
                    last = "a checksum request"
                    self.status.phase = "computing the checksums of the weights pushed"
                    sums = self.worker.engine.weight_checksums(requests[0]["names"])
                    replies, answer = [{"checksums": sums}] * len(self.clients), "the weights' checksums"
                elif kind == "score":
                    last = "a sync probe"
                    self.status.phase = "scoring the sync probe"
                    logprobs = self.worker.engine.score(requests[0]["ids"], requests[0]["temperature"])
                    replies, answer = [{"logprobs": logprobs}] * len(self.clients), "the sync probe's log-probs"
                else:
                    raise RuntimeError(f"unknown request {kind!r}")
            except Exception:
                self.reply([{"error": traceback.format_exc(limit=-3)}] * len(self.clients), f"the error of {last}")
                raise
            self.reply(replies, answer)

    def close(self) -> None:
        self.status.close()
        if self.worker is not None:
            self.worker.close()


def serve(settings: RolloutConfig, ctx: DistContext, *, chat_template: str | None, seed: int,
          num_threads: int | None) -> None:
    """Serve the trainer ranks until they stop (a rollout rank's whole run): `settings` is the rollout
    section; the actor's chat template, the run's seed and torch threads come with it."""
    server = RolloutServer(settings, ctx, chat_template=chat_template, seed=seed, num_threads=num_threads)
    try:
        server.serve()
    finally:
        server.close()
