"""A dedicated rollout rank's life (`rollout.ranks=K`): load the engine and the environments, then serve
the trainer ranks assigned to it until they say stop (train/parallel/rollout_bridge.py for the
groups, train/workers/remote_rollout.py for the trainer's side).

Each request comes from every trainer rank this rank serves, in the same order on all of them (the
trainer's step loop is the same on every rank): rollouts of several trainer ranks run together, in
one engine batch; a weight push is received once, from trainer rank 0's broadcast. Waiting for the
next request gives up after `rollout.async_timeout_s`, naming the last request served.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Iterator

import torch
from omegaconf import DictConfig
from transformers import AutoTokenizer

from train.engines import build_engine
from train.parallel.distributed import DistContext, set_cpu_threads
from train.parallel.rollout_bridge import Bridge
from train.trainer.config import env_paths
from train.utils import hub
from train.workers.env_routing import EnvRouter
from train.workers.rollout import RolloutWorker


def received_weights(bridge: Bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one push, bucket by bucket, as trainer rank 0 broadcasts them."""
    i = 0
    while True:
        meta = bridge.broadcast_object(None, f"for bucket {i} of the weight push from trainer rank 0")
        if meta.get("end"):
            return
        dtype, tensors = meta["dtype"], meta["tensors"]
        sizes = [int(torch.Size(shape).numel()) for _, shape in tensors]
        flat = torch.empty(sum(sizes), dtype=dtype)
        bridge.broadcast(flat.view(torch.uint8), f"for bucket {i}'s bytes from trainer rank 0")
        for (name, shape), part in zip(tensors, flat.split(sizes)):
            yield name, part.view(shape)
        i += 1


def local_folder(folder: str, name: str, kind: str) -> str:
    """The trainer rank's folder for a model, or (on another node, where that folder may not exist)
    the model's name resolved on this one (a Hub id is fetched into this node's cache)."""
    return folder if os.path.isdir(folder) else hub.resolve(name, kind)


class RolloutServer:
    def __init__(self, cfg: DictConfig, ctx: DistContext) -> None:
        self.cfg, self.ctx, self.bridge = cfg, ctx, ctx.bridge
        self.clients = ctx.split.clients_of(ctx.rank)
        self.timeout_s = float(cfg.rollout.async_timeout_s)
        self.worker: RolloutWorker | None = None

    def receive(self, after: str) -> list[dict]:
        """The next request from every trainer rank served (the same kind from each)."""
        requests = [self.bridge.recv(c, f"the next request after {after}", self.timeout_s) for c in self.clients]
        kinds = [r["kind"] for r in requests]
        if len(set(kinds)) != 1:
            raise RuntimeError(f"rollout rank {self.ctx.rank}: trainer ranks {self.clients} sent different requests "
                               f"{kinds} (their step loops diverged)")
        return requests

    def reply(self, replies: list[dict]) -> None:
        for client, message in zip(self.clients, replies):
            self.bridge.send(message, client, "a reply")

    def setup(self, hello: dict) -> None:
        cfg = self.cfg
        set_cpu_threads(self.ctx, cfg.trainer.num_threads)
        model_dir, tokenizer_dir = (local_folder(hello[key], hello[f"{key}_name"], kind)
                                    for key, kind in (("model", "model"), ("tokenizer", "tokenizer")))
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        if cfg.actor.chat_template:
            tokenizer.chat_template = cfg.actor.chat_template
        env = EnvRouter(env_paths(cfg), timeout_s=cfg.rollout.env_timeout_s, max_workers=cfg.rollout.env_workers,
                        max_turns=cfg.rollout.max_turns)
        engine = build_engine(cfg.rollout, self.ctx, model_path=model_dir, tokenizer=tokenizer,
                              seed=cfg.trainer.seed)
        self.worker = RolloutWorker(engine, env, tokenizer, max_turns=cfg.rollout.max_turns,
                                    env_error_reward=cfg.rollout.env_error_reward,
                                    max_total_length=hello["max_total_length"])

    def rollout(self, requests: list[dict]) -> list[dict]:
        engine = self.worker.engine
        engine.weight_version = requests[0]["version"]
        before = float(engine.stats["generation_seconds"])
        outs, seconds = self.worker.rollout_many([(r["rows"], r["n"], r["sampling"], r["seed"]) for r in requests])
        engine_seconds = float(engine.stats["generation_seconds"]) - before
        calls, stuck = self.worker.pop_api_calls(), self.worker.stuck_calls
        # the shared environment's calls and stuck threads are reported once, to the first trainer rank
        return [{"samples": samples, "seconds": seconds, "engine_seconds": engine_seconds,
                 "tokens": float(sum(sum(s.turn_lengths) for s in samples)),
                 "api_calls": calls if i == 0 else [], "stuck_calls": stuck if i == 0 else 0}
                for i, samples in enumerate(outs)]

    def serve(self) -> None:
        requests = self.receive("start-up (the trainer ranks' set-up)")
        if requests[0]["kind"] != "hello":
            raise RuntimeError(f"rollout rank {self.ctx.rank}: the first request was {requests[0]['kind']!r}, not hello")
        try:
            self.setup(requests[0])
        except Exception as e:  # the trainer ranks say it, naming this rank
            self.reply([{"error": f"{type(e).__name__}: {e}"}] * len(self.clients))
            raise
        self.reply([{"dtype": self.worker.engine.dtype}] * len(self.clients))
        last = "set-up"
        while True:
            requests = self.receive(last)
            kind = requests[0]["kind"]
            if kind == "stop":
                return
            if kind == "weights":  # the version comes with the next rollout request
                self.worker.engine.update_weights(received_weights(self.bridge))
                last = "a weight push"
                continue
            try:
                if kind == "rollout":
                    replies = self.rollout(requests)
                    last = requests[0]["what"]
                elif kind == "checksums":
                    sums = self.worker.engine.weight_checksums(requests[0]["names"])
                    replies = [{"checksums": sums}] * len(self.clients)
                    last = "a checksum request"
                elif kind == "score":
                    logprobs = self.worker.engine.score(requests[0]["ids"], requests[0]["temperature"])
                    replies = [{"logprobs": logprobs}] * len(self.clients)
                    last = "a sync probe"
                else:
                    raise RuntimeError(f"unknown request {kind!r}")
            except Exception:
                self.reply([{"error": traceback.format_exc(limit=-3)}] * len(self.clients))
                raise
            self.reply(replies)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def serve(cfg: DictConfig, ctx: DistContext) -> None:
    """Serve the trainer ranks until they stop (a rollout rank's whole run)."""
    server = RolloutServer(cfg, ctx)
    try:
        server.serve()
    finally:
        server.close()
