"""The Hydra entry point and the step loop.

    torchrun --nproc_per_node=2 -m train.trainer.grpo --config-name stub trainer.save_dir=runs/stub

One step: a batch of prompts -> multi-turn rollout with streaming rewards -> dynamic filtering ->
reference / old log-probs when needed -> advantages -> actor update -> push weights to the engine
-> checkpoint / evaluation on their schedules.
"""
from __future__ import annotations

import os
import random
import sys
import time

import hydra
import numpy as np
import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from train.datasets.dataloader import build_dataloader
from train.datasets.loading import DataError, load_rows
from train.datasets.tokenize import TokenizationError
from train.engines import make_engine
from train.engines.base import SamplingParams
from train.trainer.config import ConfigError, validate
from train.trainer.step import StepInputs, compute_advantages, filter_groups, rollout_metrics
from train.utils import api_stats
from train.utils import checkpoint as ckpt
from train.utils.distributed import DistContext, all_reduce_sum, cleanup, gather_to_main, init_distributed
from train.utils.logging import RunLogger
from train.workers.actor import Actor, TrainBatch
from train.workers.environment import EnvLoadError, Environment
from train.workers.rollout import RolloutWorker, Sample, sample_seed


def sampling_params(params: DictConfig) -> SamplingParams:
    p = OmegaConf.to_container(params, resolve=True)
    p["stop"] = tuple(p.get("stop") or ())
    return SamplingParams(**p)


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


class Trainer:
    def __init__(self, cfg: DictConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        validate(cfg, ctx.world_size)  # before anything heavy loads
        if ctx.device.type == "cpu":
            torch.set_num_threads(cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // ctx.local_world_size))
        seed_everything(cfg.trainer.seed, ctx.rank)

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor.tokenizer_name or cfg.actor.model_name)
        if cfg.actor.chat_template:
            self.tokenizer.chat_template = cfg.actor.chat_template
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.env = Environment(cfg.rollout.env_path, timeout_s=cfg.rollout.env_timeout_s,
                               max_workers=cfg.rollout.env_workers, max_turns=cfg.rollout.max_turns)
        self.train_rows = load_rows(cfg.data.train_data_path)
        self.test_rows = load_rows(cfg.data.test_data_path) if cfg.trainer.test_freq else []
        self.loader = build_dataloader(self.train_rows, batch_size=cfg.data.prompts_per_rollout // ctx.world_size,
                                       rank=ctx.rank, world_size=ctx.world_size, seed=cfg.trainer.seed,
                                       shuffle=cfg.data.shuffle)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.n_epochs * self.loader.batches_per_epoch
        self.train_sampling = sampling_params(cfg.rollout.train_sampling_params)
        self.test_sampling = sampling_params(cfg.rollout.test_sampling_params)

        temperature = self.train_sampling.temperature or 1.0
        updates = self.total_steps * cfg.actor.update_per_rollout * cfg.actor.mini_batches
        self.actor = Actor(cfg.actor, ctx, cfg.actor.model_name, pad_token_id=self.pad_id, train=True,
                           temperature=temperature, total_updates=updates)
        self.ref = None
        if cfg.actor.kl.coef > 0:
            self.ref = Actor(cfg.actor, ctx, cfg.ref_actor.model_name or cfg.actor.model_name,
                             pad_token_id=self.pad_id, train=False, temperature=temperature)
        self.engine = make_engine(cfg.rollout.engine, path=cfg.actor.model_name, tokenizer=self.tokenizer,
                                  device=ctx.device, max_batch_size=cfg.rollout.max_batch_size,
                                  seed=cfg.trainer.seed + ctx.rank)
        max_len = getattr(self.actor.model.config, "max_position_embeddings", 4096)
        self.rollout = RolloutWorker(self.engine, self.env, self.tokenizer, max_turns=cfg.rollout.max_turns,
                                     env_error_reward=cfg.rollout.env_error_reward, max_total_length=max_len)
        self.start_step = 0
        self.test_history: list[tuple[int, float]] = []
        self._maybe_resume()
        self.log = RunLogger(cfg, ctx.is_main, self.total_steps, self.start_step)

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> None:
        source = self.cfg.trainer.load_ckpt_from
        if source is None:
            return
        path = ckpt.find_latest(self.cfg.trainer.save_dir) if source == "latest" else source
        if path is None:  # `latest` with nothing saved yet: a fresh start (restart-on-preemption loops)
            return
        state, rank_state = ckpt.load_checkpoint(path, self.actor.model, self.actor.optimizer,
                                                 self.actor.scheduler, self.ctx)
        self.start_step = state["step"]
        self.test_history = [tuple(x) for x in state.get("test_history", [])]
        self.loader.load_state_dict(rank_state["dataloader"])
        ckpt.set_rng_state(rank_state["rng"])
        self.push_weights()

    def save(self, step: int) -> None:
        path = ckpt.save_checkpoint(
            self.cfg.trainer.save_dir, step, self.actor.model, self.actor.optimizer, self.actor.scheduler,
            {"step": step, "test_history": self.test_history},
            {"dataloader": self.loader.state_dict(), "rng": ckpt.rng_state()}, self.ctx)
        self.log.event("checkpoint", step, {"path": path})

    # -- one step --------------------------------------------------------------------------
    def push_weights(self) -> float:
        start = time.perf_counter()
        self.engine.update_weights(self.actor.named_full_tensors())
        return time.perf_counter() - start

    def train_step(self, step: int) -> dict[str, float]:
        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        rows = self.loader.next_batch()
        n = cfg.data.responses_per_prompt
        seed = sample_seed(cfg.trainer.seed, step, ctx.rank * len(rows) * n)
        samples, rollout_s = self.rollout.rollout(rows, n, self.train_sampling, seed)
        metrics = rollout_metrics(samples, len(rows), n, cfg, ctx)
        metrics.update(self._log_samples(step, samples))

        kept = filter_groups(samples, n, cfg.rollout.dynamic_filtering, cfg.rollout.mask_truncated)
        n_kept = all_reduce_sum([float(len(kept))], ctx.device)[0]
        metrics["time/rollout_s"] = rollout_s
        t1 = time.perf_counter()
        if n_kept == 0:  # nothing to learn from on any rank: skip together, no collective left hanging
            metrics["actor/skipped"] = 1.0
        elif step <= cfg.actor.freeze_steps:
            metrics["actor/frozen"] = 1.0
        else:
            metrics.update(self._update(kept, n))
            metrics["time/weight_sync_s"] = self.push_weights()
        metrics["time/update_s"] = time.perf_counter() - t1 - metrics.get("time/weight_sync_s", 0.0)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _update(self, kept: list[Sample], n: int) -> dict[str, float]:
        cfg = self.cfg
        ids = [s.ids for s in kept]
        masks = [s.action_mask for s in kept]
        inputs = StepInputs(kept, n)
        ref_logp = self.ref.compute_logprobs(ids, masks) if self.ref is not None else None
        advantages, adv_metrics = compute_advantages(inputs, cfg, self.ctx, ref_logp)
        old_logp = None
        if cfg.actor.update_per_rollout > 1 or cfg.actor.mini_batches > 1:
            old_logp = self.actor.compute_logprobs(ids, masks)  # with one update the ratio is 1: skip
        batch = TrainBatch(ids, masks, advantages,
                           [torch.tensor(s.sampler_logprobs[1:], dtype=torch.float32) for s in kept],
                           old_logp, ref_logp)
        metrics = self.actor.update(batch, self.train_sampling.max_new_tokens)
        metrics.update(adv_metrics)
        return metrics

    def _log_samples(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Sampled conversations, env errors and external-call latencies to rank 0's logs;
        returns the latency metrics (on rank 0)."""
        k = self.cfg.trainer.log_samples
        errors = [{"error": s.env_error, "messages": s.messages} for s in samples if s.env_error]
        shown = [{"messages": s.messages, "answer": s.answer, "reward": s.reward, "finish_reason": s.finish_reason,
                  "n_turns": s.n_turns, "events": s.events} for s in samples[:k]]
        calls = self.env.pop_api_calls()
        gathered = gather_to_main({"errors": errors, "samples": shown, "calls": calls}, self.ctx)
        if gathered is None:
            return {}
        all_calls = []
        for rank, part in enumerate(gathered):
            for e in part["errors"]:
                self.log.event("env_error", step, {"rank": rank, **e})
            for s in part["samples"]:
                self.log.event("sample", step, {"rank": rank, **s})
            all_calls += part["calls"]
        stats = api_stats.summarize(all_calls)
        if stats:
            self.log.event("api_stats", step, {"stats": stats})
        return stats

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, step: int) -> float:
        ctx = self.ctx
        rows = self.test_rows[ctx.rank::ctx.world_size]
        samples, _ = self.rollout.rollout(rows, 1, self.test_sampling, sample_seed(self.cfg.trainer.seed, -1, ctx.rank))
        total, count, errors = all_reduce_sum(
            [sum(s.reward for s in samples), float(len(samples)), float(sum(bool(s.env_error) for s in samples))],
            ctx.device)
        score = total / max(count, 1.0)
        self.test_history.append((step, score))
        self.log.event("eval", step, {"rewards/test": score, "n": count, "env_errors": errors})
        return score

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.cfg
        test_freq, save_freq = cfg.trainer.test_freq, cfg.trainer.save_freq
        if test_freq and self.start_step == 0:
            score = self.evaluate(0)
            self.log.log_metrics(0, {"rewards/test": score})
            self.log.write(f"step 0: test reward {score:.3f}")
        for step in range(self.start_step + 1, self.total_steps + 1):
            metrics = self.train_step(step)
            if test_freq and (step % test_freq == 0 or step == self.total_steps):
                t = time.perf_counter()
                metrics["rewards/test"] = self.evaluate(step)
                metrics["time/eval_s"] = time.perf_counter() - t
                self.log.write(f"step {step}: test reward {metrics['rewards/test']:.3f}")
            if save_freq and step % save_freq == 0:
                self.save(step)
            self.log.log_metrics(step, metrics)
            self.log.progress(step, metrics)
        ckpt.export_hf(self.actor.model, self.tokenizer, os.path.join(cfg.trainer.save_dir, "latest"), self.ctx)
        if len(self.test_history) >= 2:
            (s0, first), (s1, last) = self.test_history[0], self.test_history[-1]
            self.log.write(f"test reward: {first:.3f} (step {s0}) -> {last:.3f} (step {s1}), {last - first:+.3f}")
        elif not test_freq:
            self.log.write("evaluation off (trainer.test_freq=null)")

    def close(self) -> None:
        self.log.close()
        self.rollout.close()


def run(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()  # our own bar is the one to watch
    ctx = init_distributed()
    try:
        trainer = Trainer(cfg, ctx)
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        cleanup()


# Mistakes a user can fix (config, data, env module, chat template): one clear line, no traceback.
USER_ERRORS = (ConfigError, DataError, EnvLoadError, TokenizationError)


@hydra.main(config_path="../../config", config_name="grpo", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except USER_ERRORS as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
