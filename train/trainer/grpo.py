"""The Hydra entry point and the step loop.

    .venv/bin/torchrun --nproc_per_node=2 -m train.trainer.grpo --config-name stub trainer.save_dir=runs/stub

One step: a batch of prompts -> multi-turn rollout with streaming rewards -> dynamic filtering ->
reference / old log-probs when needed -> advantages -> actor update -> push weights to the engine
-> checkpoint / evaluation on their schedules.
"""
from __future__ import annotations

import errno
import os
import random
import sys
import time
from typing import NoReturn

# The rollout engine computes in its own thread and the update in the main thread, each with its own
# OpenMP team, and both run thousands of small ops per step: worker threads that go to sleep between
# ops pay a wake-up each time (measured on the 2-core CPU, stub model: 0.09-0.11 s per step spinning
# against 0.16 s with the runtime's default and 0.20 s with PASSIVE; docs/training.md). With one
# thread per rank (torchrun's default) there is no worker to spin. Read by the OpenMP runtime when
# torch loads, so it is set before torch is imported; a user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

if __name__ == "__main__":  # a rank started by torchrun dies with its agent, from the first moment on
    from train.runtime.lifecycle import die_with_parent

    die_with_parent()

import hydra
import numpy as np
import torch
import transformers
from omegaconf import DictConfig
from transformers import AutoTokenizer

from train.datasets.curriculum import Curriculum, CurriculumConfig
from train.datasets.dataloader import build_dataloader
from train.datasets.loading import DataError
from train.datasets.mixture import load_sources, mixture_shares, source_names
from train.datasets.tokenize import TokenizationError, encode
from train.engines import build_engine
from train.models.actor import Actor, AdapterFreeReference
from train.models.critic import Critic
from train.models.lora import LoraTargetError
from train.models.model_init import ModelWeightsError
from train.parallel.collectives import (all_gather_flat, all_reduce_max_many, all_reduce_sum, broadcast_from_main,
                                        gather_to_main)
from train.parallel.distributed import DistContext, cleanup, init_distributed, set_cpu_threads
from train.parallel.layout import Layout, layout_for
from train.parallel.rollout_bridge import BridgeError
from train.parallel.step_batch import BatchIndex, StepBatch, dispatch, exchange_index, transfer
from train.runtime import checkpoint as ckpt
from train.runtime.export import GB, export_hf
from train.runtime.lifecycle import StopRequest
from train.runtime.logging import RunLogger, test_line
from train.runtime.run_folder import RunFolderError, claim
from train.runtime.watchdog import Watchdog
from train.trainer.advantages import compute_advantages
from train.trainer.config import (ConfigError, collective_timeout_s, data_sources, quote_values_with_equals,
                                  resolve_aliases, role_config, rollout_ranks, sampling_params, useless_settings,
                                  validate)
from train.trainer.data_check import PromptOverflowLog, check_data, context_length, overflowed_rows, overlong_error
from train.trainer.governor import Governor
from train.trainer.policy_sync import PolicySync
from train.trainer.prefetch import RolloutPrefetcher, RolloutTimeout, StepRollout, staleness
from train.trainer.step import (RunningMoments, mask_truncated, per_source_sums, rollout_metrics, select_groups,
                                shaped_rewards, split_triples)
from train.trainer.sync_check import WeightSyncError, actor_logprobs, check_probe, probe_tolerance
from train.utils import algorithms as alg
from train.utils import api_stats, hub
from train.utils.disk import UNWRITABLE_ERRNOS, StorageError, is_under, unwritable_line
from train.utils.torchrun_errors import record_for_torchrun
from train.workers.env_routing import EnvRouter, env_paths
from train.workers.environment import EnvLoadError
from train.workers.remote_rollout import RemoteEngine, RemoteRollout
from train.workers.rollout import PROMPT_TOO_LONG, RolloutWorker, Sample, sample_seed
from train.workers.rollout_server import serve


# The sync probe's text: any fixed sequence works; the engine and the trainer score the same tokens.
PROBE_TEXT = "The rollout engine samples from the weights the trainer has just pushed: 1 2 3 4 5 6 7 8 9 10."


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


class Trainer:
    def __init__(self, cfg: DictConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        resolve_aliases(cfg)
        timeout = cfg.trainer.model_fetch_timeout_s
        # Before anything heavy loads; Hub models are fetched once per node here.
        self.paths = paths = validate(cfg, ctx.world_size,
                                      resolve=lambda names: hub.resolve_on_node(names, ctx.local_rank, timeout))
        # The folder is this run's (or the resumed run's) before anything loads or is written into it.
        self.run_folder, moved = claim(cfg.trainer.save_dir, cfg.trainer.load_ckpt_from, cfg.trainer.overwrite, ctx)
        set_cpu_threads(ctx, cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed, ctx.rank)

        self.tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer)
        # The engine's tokenizer (templating prompts, decoding replies): the same vocabulary (checked).
        self.rollout_tokenizer = (self.tokenizer if paths.rollout_tokenizer == paths.tokenizer
                                  else AutoTokenizer.from_pretrained(paths.rollout_tokenizer))
        if cfg.actor.chat_template:
            self.tokenizer.chat_template = self.rollout_tokenizer.chat_template = cfg.actor.chat_template
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        # Each row's environment: one for all, or one per data source (rollout.env_path as a mapping).
        self.env = EnvRouter(env_paths(cfg), timeout_s=cfg.rollout.env_timeout_s,
                             max_workers=cfg.rollout.env_workers, max_turns=cfg.rollout.max_turns)
        train_sources, test_sources = data_sources(cfg)
        self.train_rows = load_sources(train_sources)
        self.test_rows = load_sources(test_sources) if cfg.trainer.test_freq else []
        # Per-source metrics (rewards/train/<source>, ...): the same list on every rank.
        self.train_sources, self.test_sources = source_names(self.train_rows), source_names(self.test_rows)
        # The conversation limit, from the config (rollout.max_total_length) or the model's, before any model loads.
        self.context = context_length(cfg, paths.actor)
        # Rank 0 checks the data (train/trainer/data_check.py: sources routed, contamination, which hashes
        # the training n-grams, the first data.check_rows prompts' lengths); every rank gets the outcome.
        try:
            found = (check_data(cfg, self.train_rows, self.test_rows, self.env.routes, self.rollout_tokenizer,
                                self.context) if ctx.is_main else None)
        except DataError as e:
            found = f"{e}"
        found = broadcast_from_main(found, ctx)
        if isinstance(found, str):
            raise DataError(found)
        self.data_warnings = found.warnings
        # rows skipped at rollout time, named on rank 0 (those named at start-up only counted)
        self.prompt_overflows = PromptOverflowLog(self.context, found.overlong_rows)
        # Per-prompt pass rates, kept in every run; a policy other than uniform also decides what is drawn.
        self.curriculum = Curriculum(CurriculumConfig(**cfg.data.curriculum), self.train_rows, cfg.trainer.seed)
        accept = self.curriculum.accept if cfg.data.curriculum.policy != "uniform" else None
        self.loader = build_dataloader(self.train_rows, batch_size=cfg.data.prompts_per_rollout // ctx.world_size,
                                       rank=ctx.rank, world_size=ctx.world_size, seed=cfg.trainer.seed,
                                       shuffle=cfg.data.shuffle, accept=accept,
                                       **mixture_shares(train_sources, self.train_rows))
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.n_epochs * self.loader.batches_per_epoch
        self.train_sampling = sampling_params(cfg, "rollout.train_sampling_params")
        self.test_sampling = sampling_params(cfg, "rollout.test_sampling_params")
        # Request seeds derive from (base seed, step, sample): sampling_params.seed, else trainer.seed.
        self.train_seed = cfg.trainer.seed if self.train_sampling.seed is None else self.train_sampling.seed
        self.test_seed = cfg.trainer.seed if self.test_sampling.seed is None else self.test_sampling.seed

        temperature = self.train_sampling.temperature or 1.0
        self._layouts: dict[tuple[int, int, int], Layout] = {}
        updates = self.total_steps * cfg.actor.update_per_rollout * cfg.actor.mini_batches
        self.actor = Actor(cfg.actor, ctx, paths.actor, pad_token_id=self.pad_id, train=True,
                           temperature=temperature, total_updates=updates, layout=self._layout("actor"),
                           adapter_seed=cfg.trainer.seed)
        self.ref = None
        same_base = os.path.realpath(paths.reference) == os.path.realpath(paths.actor)
        if cfg.actor.kl.coef > 0 and self.actor.lora.enabled and same_base:
            self.ref = AdapterFreeReference(self.actor)  # the base model is the actor with its adapters off
        elif cfg.actor.kl.coef > 0:
            self.ref = Actor(role_config(cfg, "ref_actor"), ctx, paths.reference,
                             pad_token_id=self.pad_id, train=False, temperature=temperature,
                             layout=self._layout("ref_actor"))
        self.critic = None
        if cfg.adv.estimator == "gae":
            critic_updates = self.total_steps * cfg.critic.update_per_rollout * cfg.critic.mini_batches
            self.critic = Critic(cfg.critic, ctx, paths.critic, pad_token_id=self.pad_id,
                                 total_updates=critic_updates, layout=self._layout("critic"),
                                 adapter_seed=cfg.trainer.seed)
        # What an update changes, by name: checkpoints and the governor's snapshots hold their state parts.
        self.workers = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        self.reward_moments = RunningMoments()  # PPO reward scaling (critic.reward_norm)
        gov = cfg.trainer.governor
        self.governor = (Governor(gov.watch, gov.window, gov.k_sigma, gov.min_history, gov.min_panics,
                                  gov.rel_std_floor, gov.max_weight_change) if gov.enable else None)
        max_len = self.context.tokens
        if ctx.bridge is not None:  # rollout.ranks > 0: a dedicated rollout rank generates and scores for this rank
            self.engine = RemoteEngine(ctx.bridge, ctx.rank, max(1, int(cfg.rollout.bucket_size_mb * (1 << 20))))
            names = {"model_name": cfg.rollout.model_name or cfg.actor.model_name,
                     "tokenizer_name": cfg.rollout.tokenizer_name or cfg.actor.tokenizer_name or cfg.actor.model_name}
            self.rollout = RemoteRollout(self.engine, {"model": paths.rollout, "tokenizer": paths.rollout_tokenizer,
                                                       "max_total_length": max_len, **names})
        else:
            self.engine = build_engine(cfg.rollout, ctx, model_path=paths.rollout, tokenizer=self.rollout_tokenizer,
                                       seed=cfg.trainer.seed, lora=self.actor.lora if self.actor.lora.enabled else None)
            self.rollout = RolloutWorker(self.engine, self.env, self.rollout_tokenizer, max_turns=cfg.rollout.max_turns,
                                         env_error_reward=cfg.rollout.env_error_reward, max_total_length=max_len,
                                         max_env_chars=cfg.rollout.max_env_chars)
        self.start_step = 0
        self.test_history: list[tuple[int, float]] = []
        self.checkpointer = ckpt.Checkpointer(cfg.trainer.save_dir, ctx, async_save=cfg.trainer.async_save,
                                              keep_last_n=cfg.trainer.keep_last_n)
        # rollout.max_staleness=k: step N+k's rollout runs while step N trains (train/trainer/prefetch.py).
        self.prefetch = (RolloutPrefetcher(lambda step, generated: self._rollout(step, on_generated=generated),
                                           cfg.rollout.async_timeout_s)
                         if cfg.rollout.max_staleness > 0 else None)
        resumed = self._maybe_resume()
        self.trainer_version = self.start_step  # the step whose update made the actor's weights
        self.engine.weight_version = self.start_step
        self.log = RunLogger(cfg, ctx.is_main, self.total_steps, self.start_step)
        if moved:
            self.log.write(f"trainer.overwrite: the run that was in {cfg.trainer.save_dir} is now in {moved}")
        for warning in useless_settings(cfg) + self.data_warnings:  # (contamination, prompts that fill the context)
            self._warn(self.start_step, warning)
        self.skipped_in_a_row = self.updates = 0
        # Why each step of this launch changed no actor weight (the closing line's causes), and the
        # sources (None: a run without) whose every sample failed in the env, warned once per streak.
        self.outcomes: dict[str, int] = {}
        self._env_failing: set[str | None] = set()
        self._all_env_errors = False  # (rank 0) every sample of the last step was an env error
        self._warned_stuck = False
        self.watchdog = Watchdog(cfg.trainer.watchdog_min_s, cfg.trainer.watchdog_factor, ctx.rank,
                                 cfg.trainer.save_dir, describe=self.env.longest_call)
        self.sync = PolicySync(self.actor.model, self.engine, cfg.rollout.bucket_size_mb, self.governor,
                               self.workers, self.log, verify=cfg.trainer.verify_push, watchdog=self.watchdog,
                               push_timeout_s=cfg.rollout.push_timeout_s, device=ctx.device, rank=ctx.rank)
        # The sync probe: a fixed sequence both sides score (trainer.sync_probe_every).
        self.probe_ids = encode(self.rollout_tokenizer, PROBE_TEXT)[:128]
        self.probe_tol = probe_tolerance(cfg.trainer.sync_probe_tol, getattr(self.engine, "dtype", torch.float32),
                                         cfg.actor.dtype)
        self.temperature = temperature
        if resumed or self.actor.lora.enabled or os.path.realpath(paths.rollout) != os.path.realpath(paths.actor):
            # the engine loaded rollout.model_name (or the run's start, or fresh adapters): sample from the actor
            self.sync.push(self.start_step)
        self._log_layouts()

    def _layout(self, role: str) -> Layout:
        """Each model's meshes; models with the same sizes share them (one set of process groups)."""
        section = role_config(self.cfg, role)
        key = tuple(section.get(k) or 1 for k in ("ddp_size", "tp_size", "sp_size"))
        if key not in self._layouts:
            self._layouts[key] = layout_for(section, self.ctx.world_size, self.ctx.device.type, role,
                                            timeout_s=self.ctx.collective_timeout_s)
        return self._layouts[key]

    def _log_layouts(self) -> None:
        """One line (and a `layout` event) saying how each model is laid out on the ranks."""
        # a LoRA actor's reference is the actor itself (adapters off): no model of its own to lay out
        ref = None if isinstance(self.ref, AdapterFreeReference) else self.ref
        models = {"actor": self.actor, "ref_actor": ref, "critic": self.critic}
        layouts = {role: vars(m.layout.sizes) for role, m in models.items() if m is not None}
        split = self.ctx.split
        every = split.world_size if split is not None else self.ctx.world_size
        nodes = max(1, every // max(self.ctx.local_world_size, 1))
        rollout_ranks = split.rollout_ranks if split is not None else 0
        self.log.event("layout", self.start_step, {"world_size": self.ctx.world_size, "nodes": nodes,
                                                   "rollout_ranks": rollout_ranks, **layouts})
        parts = [f"{role} " + " ".join(f"{k}={v}" for k, v in sizes.items()) for role, sizes in layouts.items()]
        if rollout_ranks:
            parts.append(f"{rollout_ranks} dedicated rollout rank(s) (rollout.ranks)")
        self.log.write(f"{self.ctx.world_size} ranks on {nodes} node(s); " + "; ".join(parts))
        for role, worker in self.workers.items():
            if worker.lora.enabled:
                trainable, total = worker.parameter_counts()
                base_ref = worker is self.actor and ref is not self.ref
                reference = "; KL reference: the base (adapters off)" if base_ref else ""
                self.log.write(f"{role}: LoRA rank {worker.lora.rank} (alpha {worker.lora.alpha:g}) on "
                               f"{', '.join(worker.lora.target_modules)}: {trainable / 1e6:.3g}M trainable "
                               f"parameters of {total / 1e6:.4g}M{reference}")

    # -- checkpoints -----------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        """Restore a checkpoint if asked; whether one was restored."""
        source = self.cfg.trainer.load_ckpt_from
        if source is None:
            return False
        path = ckpt.find_latest(self.cfg.trainer.save_dir) if source == "latest" else source
        if path is None:  # `latest` with nothing saved yet: a fresh start (restart-on-preemption loops)
            return False
        state, rank_state = self.checkpointer.load(path, self.workers)
        self.start_step = state["step"]
        self.test_history = [tuple(x) for x in state.get("test_history", [])]
        if "reward_moments" in state:
            self.reward_moments.load_state_dict(state["reward_moments"])
        if self.governor is not None and "governor" in state:
            self.governor.load_state_dict(state["governor"])
        if "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
        self.loader.load_state_dict(state["dataloader"])  # global: any world size resumes at the same prompts
        pending = state.get("pending_rollout")  # an asynchronous run's finished, untrained rollouts
        if pending is not None:
            mine = rank_state.get("pending_rollout") if rank_state is not None else None
            if isinstance(mine, StepRollout):  # saved before several could be pending
                mine = [mine]
            same = (pending["world_size"] == self.ctx.world_size
                    and pending.get("max_staleness", 1) == self.cfg.rollout.max_staleness)
            if self.prefetch is not None and same and mine:
                self.prefetch.restore(mine)  # trained as they were generated: bit-exact
            else:  # another world size or staleness, or a synchronous resume: those prompts are rolled out again
                self.loader.load_state_dict(pending["loader_before"])
        if rank_state is not None:
            ckpt.set_rng_state(rank_state["rng"])
        else:  # a rank the saving run did not have: a seed of its own, the same on every resume
            seed_everything(self.cfg.trainer.seed + 7919 * self.start_step, self.ctx.rank)
        return True

    def save(self, step: int) -> float:
        """A checkpoint of `step` (train/utils/checkpoint.py); the seconds the step loop waited."""
        start = time.perf_counter()
        state = {"step": step, "test_history": self.test_history, "reward_moments": self.reward_moments.state_dict(),
                 "dataloader": self.loader.state_dict()}
        if self.governor is not None:
            state["governor"] = self.governor.state_dict()
        state["curriculum"] = self.curriculum.state_dict()
        if self.ctx.is_main:
            self.curriculum.stats.dump(os.path.join(self.cfg.trainer.save_dir, "prompt_stats.jsonl"))
        rank_state = {"rng": ckpt.rng_state()}
        pending = self.prefetch.pending() if self.prefetch is not None else []
        if pending:  # generated with earlier weights: kept, not regenerated
            state["pending_rollout"] = {"steps": [p.step for p in pending], "world_size": self.ctx.world_size,
                                        "max_staleness": self.cfg.rollout.max_staleness,
                                        "loader_before": pending[0].loader_before}
            rank_state["pending_rollout"] = pending
        path = self.checkpointer.save(step, self.workers, state, rank_state)
        self.log.event("checkpoint", step, {"path": path, "async": self.checkpointer.async_save})
        return time.perf_counter() - start

    # -- one step --------------------------------------------------------------------------
    def _rollout(self, step: int, round_: int = 0, on_generated=None) -> StepRollout:
        """One rollout of this rank's next prompts. No collective: with rollout.max_staleness=1 it runs
        on the prefetch thread while the main thread trains (`on_generated`: see RolloutWorker.rollout)."""
        cfg, ctx = self.cfg, self.ctx
        loader_before = self.loader.state_dict()
        rows = self.loader.next_batch()
        n = cfg.data.responses_per_prompt
        # round 0 keeps the seeds of a plain step; refills draw fresh ones
        seed = sample_seed(self.train_seed, step, (round_ * ctx.world_size + ctx.rank) * len(rows) * n)
        before = self._engine_counters()
        samples, rollout_s = self.rollout.rollout(rows, n, self.train_sampling, seed, what=f"step {step}'s rollout",
                                                  on_generated=on_generated)
        counters = tuple(a - b for a, b in zip(self._engine_counters(), before))
        rewards, penalties = shaped_rewards(samples, cfg)
        return StepRollout(step, samples, rewards, penalties, rollout_s, counters, loader_before,
                           list(self.loader.last_indices))

    def collect(self, step: int, first: StepRollout
                ) -> tuple[list[Sample], list[float], list[Sample], list[float], dict[str, float]]:
        """Rollouts for one step, starting from `first` (this step's rollout, made now or prefetched):
        (all samples, their shaped rewards, kept samples, kept rewards, metrics).

        With `rollout.dynamic_sampling` (DAPO), new prompts are drawn and rolled out until the kept
        (informative) groups of all ranks reach `prompts_per_rollout`, at most
        `rollout.dynamic_sampling_max_rounds` rounds; the surplus is trimmed evenly across ranks. Each
        decision uses all-reduced counts, so every rank runs the same number of rounds."""
        cfg, ctx = self.cfg, self.ctx
        n = cfg.data.responses_per_prompt
        dynamic = cfg.rollout.dynamic_sampling
        target = cfg.data.prompts_per_rollout
        all_samples, all_rewards, penalties, kept, kept_r = [], [], [], [], []
        rollout_s, rounds, counters = 0.0, 0, [0.0, 0.0]
        max_rounds = cfg.rollout.dynamic_sampling_max_rounds if dynamic else 1
        pass_rates: list[tuple[int, float]] = []  # (row index, share of its group that passed)
        threshold = cfg.data.curriculum.pass_threshold
        while rounds < max_rounds:
            got = first if rounds == 0 else self._rollout(step, rounds)
            samples, rewards, pen = got.samples, got.rewards, got.penalties
            pass_rates += [(pid, sum(s.reward >= threshold for s in samples[g * n:(g + 1) * n]) / n
                            if samples[g * n].finish_reason != PROMPT_TOO_LONG else float("nan"))  # not rolled out
                           for g, pid in enumerate(got.row_indices)]
            rounds += 1
            rollout_s += got.rollout_s
            counters = [a + b for a, b in zip(counters, got.engine_counters)]
            all_samples += samples
            all_rewards += rewards
            penalties += pen
            k, kr = select_groups(samples, rewards, n, cfg.rollout.dynamic_filtering or dynamic)
            kept += k
            kept_r += kr
            if not dynamic:
                break
            counts = [0.0] * ctx.world_size
            counts[ctx.rank] = float(len(kept) // n)
            counts = [int(c) for c in all_reduce_sum(counts, ctx.device)]
            if sum(counts) >= target:
                break
        metrics = rollout_metrics(all_samples, len(all_samples) // n, n, cfg, ctx, rewards=all_rewards,
                                  sources=self.train_sources)
        if metrics["prompt_overflow_ratio/train"] > 0:  # (all-reduced: every rank takes this branch)
            self._prompt_overflows(step, all_samples, n)
        metrics["time/rollout_s"] = rollout_s
        metrics.update(self._engine_metrics(step, counters))
        metrics.update(self._staleness_metrics(all_samples))
        metrics.update(self._record_pass_rates(step, pass_rates))
        if cfg.rollout.overlong_buffer:
            total, count = all_reduce_sum([sum(penalties), float(len(penalties))], ctx.device)
            metrics["rewards/overlong_penalty"] = total / max(count, 1.0)
        if dynamic:
            quota = alg.split_quota(counts, target)[ctx.rank]
            kept, kept_r = kept[: quota * n], kept_r[: quota * n]
            metrics["dynamic_sampling/rounds"] = float(rounds)
            metrics["dynamic_sampling/groups"] = float(min(sum(counts), target))
            if sum(counts) < target:
                self.log.event("dynamic_sampling.short", step, {"rounds": rounds, "groups": sum(counts),
                                                                "target": target})
        if cfg.rollout.mask_truncated:
            mask_truncated(kept)
        return all_samples, all_rewards, kept, kept_r, metrics

    def train_step(self, step: int, boundary: bool = True) -> dict[str, float]:
        """One step. With `boundary` (an evaluation or the run's end follows) nothing is left in flight;
        otherwise the next rollout may still be computing rewards when it returns."""
        cfg, ctx = self.cfg, self.ctx
        t0 = time.perf_counter()
        n = cfg.data.responses_per_prompt
        with self.watchdog.phase("rollout"):
            self.engine.wake()  # a no-op on CPU; SGLang takes its GPU memory back for the rollout
            waited: dict[str, float] = {}
            if self.prefetch is not None and self.prefetch.in_flight and self.prefetch.queued() == [step]:
                self._drain(waited)  # this step's rollout: generated before the last push, rewards maybe not yet
            first = self.prefetch.take(step) if self.prefetch is not None else None
            samples, _, kept, kept_r, metrics = self.collect(step, first or self._rollout(step))
            metrics.update(waited)
        if self.prefetch is not None and step < self.total_steps:
            if self.prefetch.in_flight:  # (k >= 2) the previous one may still be computing rewards
                self._drain(metrics)
            self._roll_ahead(step)
        else:
            self.engine.sleep()  # free the engine's accelerator memory for the update (no-op on CPU)
        metrics.update(self._log_samples(step, samples))
        t1 = time.perf_counter()
        # Every rank learns every kept sample's length, group and reward (the step batch's index).
        index = exchange_index([len(s.ids) for s in kept], [i // n for i in range(len(kept))], kept_r, ctx.device)
        metrics["batch/groups"] = index.size / n
        frozen = step <= cfg.actor.freeze_steps
        wait = 0.0
        if index.size == 0:  # nothing to learn from on any rank: skip together, no collective left hanging
            metrics["actor/skipped"] = 1.0
            self._note_skipped(step)
        else:
            self.skipped_in_a_row = 0
            self.updates += 1
            if frozen:
                metrics["actor/frozen"] = 1.0
            with self.watchdog.phase("update"):
                metrics.update(self._update(index, kept, update_actor=not frozen))
                change, limit = metrics.get("actor/weight_change", 0.0), cfg.trainer.governor.max_weight_change
                if self.governor is None and change > limit:
                    self._warn(step, f"step {step}'s update changed the actor's weight norm by {100 * change:.3g}% "
                                     f"(> trainer.governor.max_weight_change={limit:g}): actor.lr too high? "
                                     "trainer.governor.enable=true rolls such updates back")
                if self.prefetch is not None:  # the next step's samples all come from the weights before this update
                    wait = self._drain(metrics, generation_only=True)
                metrics.update(self.sync.after_update(step, metrics, push=not frozen))
            if not frozen and not metrics.get("governor/rollback"):
                self.trainer_version = step
            every = cfg.trainer.sync_probe_every
            if every and step % every == 0 and "time/weight_sync_s" in metrics:
                metrics["engine/probe_abs_diff"] = self.probe_sync(step)
        if boundary and self.prefetch is not None and self.prefetch.in_flight:  # evaluation uses the engine
            wait += self._drain(metrics)
        metrics["time/update_s"] = time.perf_counter() - t1 - metrics.get("time/weight_sync_s", 0.0) - wait
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def _roll_ahead(self, step: int) -> None:
        """Queue the rollouts of steps step+1 .. step+k: those missing below step+k (the first steps,
        or a resume that kept none) are made now, with the current weights; step+k's starts in the
        background, with the weights of step - 1, while this step trains."""
        k = self.cfg.rollout.max_staleness
        last = min(step + k, self.total_steps)
        queued = set(self.prefetch.queued())
        missing = [s for s in range(step + 1, last) if s not in queued]
        if missing:
            self.prefetch.restore(self.prefetch.pending() + [self._rollout(s) for s in missing])
        if last not in queued:
            self.prefetch.start(last)

    def _drain(self, metrics: dict[str, float], generation_only: bool = False) -> float:
        """Wait for the prefetched rollout (`generation_only`: until it no longer uses the engine, before
        a push); log how long each side waited for the other."""
        with self.watchdog.phase("rollout drain"):
            start = time.monotonic()
            wait = self.prefetch.wait_generated() if generation_only else self.prefetch.drain()
            done = None if generation_only else self.prefetch.last_finished()
        metrics["async/trainer_wait_s"] = metrics.get("async/trainer_wait_s", 0.0) + wait
        if done is not None:  # the rollout side sat idle from its end until now
            metrics["async/rollout_idle_s"] = max(0.0, start - done.finished_at)
        return wait

    def _record_pass_rates(self, step: int, pass_rates: list[tuple[int, float]]) -> dict[str, float]:
        """Every rank's group pass rates into the (global) prompt statistics: one all-gather of two
        floats per group (every rank has as many groups: equal batches, equal rounds)."""
        mine = torch.tensor([v for pair in pass_rates for v in pair], dtype=torch.float64, device=self.ctx.device)
        every = torch.empty(mine.numel() * self.ctx.world_size, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.world_size > 1:
            all_gather_flat(every, mine)
        else:
            every = mine
        values = every.view(-1, 2).tolist()
        self.curriculum.record(step, [(self.curriculum.id_of(int(i)), rate) for i, rate in values
                                      if rate == rate])  # NaN: a row skipped for its prompt's length
        return self.curriculum.take_counters()

    def _staleness_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """How many weight versions behind the trainer's each sample's oldest turn was (all ranks)."""
        if self.prefetch is None:
            return {}
        lags = staleness([s.turn_versions for s in samples], self.trainer_version)
        worst, = all_reduce_max_many([float(max(lags, default=0))], self.ctx.device)
        total, count = all_reduce_sum([float(sum(lags)), float(len(lags))], self.ctx.device)
        if worst > self.cfg.rollout.max_staleness:
            raise RuntimeError(f"a sample is {worst:.0f} weight versions old, past rollout.max_staleness="
                               f"{self.cfg.rollout.max_staleness} (a bug in the rollout pipeline)")
        return {"async/staleness_mean": total / max(count, 1.0), "async/staleness_max": worst}

    def probe_sync(self, step: int) -> float:
        """The engine's and the actor's log-probs of the probe sequence must agree to rounding (they
        hold the same weights after a push); the mean |difference|, or WeightSyncError. Collective."""
        score = getattr(self.engine, "score", None)
        if score is None or len(self.probe_ids) < 2:
            return float("nan")  # an engine that cannot score a sequence: the checksums are the check
        engine_logp = score(self.probe_ids, self.temperature)
        trainer_logp = actor_logprobs(self.actor, self.probe_ids, self.ctx.device)
        return check_probe(engine_logp, trainer_logp, self.probe_tol, step, self.ctx.rank, self.ctx.device)

    def _note_skipped(self, step: int) -> None:
        """Say so when `trainer.warn_skipped_steps` steps in a row learned nothing (once per streak), and at
        once when this launch's first step did (a short run's closing line must have a warning to point at)."""
        self.skipped_in_a_row += 1
        limit = self.cfg.trainer.warn_skipped_steps
        hint = ("every group's rewards were identical, so dynamic filtering dropped them all; look at rewards/train "
                "and at the samples in trajectories.jsonl (too hard, too easy, or a broken reward_fn?)")
        if limit and limit > 1 and self.updates == 0 and self.skipped_in_a_row == 1:
            self._warn(step, f"step {step} made no update: {hint} (warned once; again after {limit} such steps "
                             "in a row, trainer.warn_skipped_steps)")
        if limit and self.skipped_in_a_row == limit:
            self._warn(step, f"no update in the last {limit} steps (up to step {step}): {hint}")

    def _prompt_overflows(self, step: int, samples: list[Sample], group_size: int) -> None:
        """Rows whose prompt filled the context this step (their samples were skipped): a
        `prompt_too_long` event each and a counted warning on rank 0, or, with
        data.overlong_prompts=fail, the error on every rank. Collective."""
        gathered = gather_to_main(overflowed_rows(samples, group_size), self.ctx)
        error = None
        if gathered is not None:
            rows = [row for part in gathered for row in part]
            for row in rows:
                self.log.event("prompt_too_long", step, row)
            if self.cfg.data.overlong_prompts == "fail":
                error = overlong_error(rows[0].get("row"), rows[0]["tokens"], self.context)
            else:
                for line in self.prompt_overflows.add(rows):
                    self._warn(step, line)
        if self.cfg.data.overlong_prompts == "fail":
            raise DataError(broadcast_from_main(error, self.ctx))

    def _warn(self, step: int, warning: str) -> None:
        """A warning line on rank 0's output and a `warning` event in trajectories.jsonl."""
        self.log.write(f"warning: {warning}")
        self.log.event("warning", step, {"warning": warning})

    def _update(self, index: BatchIndex, kept: list[Sample], update_actor: bool = True) -> dict[str, float]:
        """Dispatch the kept samples once per data layout, then every pass in place on the step batch:
        reference and old log-probs, values, advantages, the critic's and the actor's updates."""
        cfg, device = self.cfg, self.ctx.device
        batches: dict[tuple[int, int], StepBatch] = {}

        def batch_for(model) -> StepBatch:  # models with the same data layout share one batch
            sizes = model.layout.sizes
            key = (sizes.dp, sizes.sp * sizes.tp)
            if key not in batches:
                batches[key] = dispatch(index, [s.ids for s in kept], [s.action_mask for s in kept],
                                        [s.sampler_logprobs for s in kept], model.layout, cfg.actor.mini_batches,
                                        device, share_prompt=cfg.actor.share_prompt)
            return batches[key]

        batch = batch_for(self.actor)
        if self.ref is not None:
            ref_batch = batch_for(self.ref)
            ref_batch.fields["ref_logp"] = self.ref.compute_logprobs(ref_batch)
            transfer(ref_batch, batch, ["ref_logp"], device)
        if cfg.actor.update_per_rollout > 1 or cfg.actor.mini_batches > 1:
            batch.fields["old_logp"] = self.actor.compute_logprobs(batch)  # with one update the ratio is 1: skip
        scale = 1.0
        if self.critic is not None:
            critic_batch = batch_for(self.critic)
            critic_batch.fields["values"] = self.critic.compute_values(critic_batch)
            transfer(critic_batch, batch, ["values"], device)
            if cfg.critic.reward_norm:
                self.reward_moments.update(index.reward)
                scale = 1.0 / (self.reward_moments.std + 1e-8) if self.reward_moments.count > 1 else 1.0
        metrics = compute_advantages(batch, cfg, device, reward_scale=scale)
        if self.critic is not None:
            transfer(batch, critic_batch, ["returns"], device)
            metrics.update(self.critic.update(critic_batch))
        if update_actor:
            metrics.update(self.actor.update(batch, self.train_sampling.max_new_tokens))
        return metrics

    def _engine_counters(self) -> tuple[float, float]:
        """The engine's running (generated tokens, generation seconds)."""
        return float(self.engine.stats["generated_tokens"]), float(self.engine.stats["generation_seconds"])

    def _engine_metrics(self, step: int, counters: list[float]) -> dict[str, float]:
        """Decode throughput of this step's rollout (`counters`: its engine tokens and seconds), summed
        over ranks (engines that count it), and the env calls stuck past their timeout."""
        tokens, seconds, stuck = all_reduce_sum([*counters, float(self.rollout.stuck_calls)], self.ctx.device)
        if stuck and not self._warned_stuck:
            self._warned_stuck = True
            self._warn(step, f"{stuck:.0f} sync env call(s) still running past rollout.env_timeout_s, each holding "
                             f"a thread (at most rollout.env_workers per rank are replaced; see env/stuck_calls): "
                             f"a reward_fn or interact in {self.env.name} that never returns?")
        return {"rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(seconds / self.ctx.world_size, 1e-9),
                "env/stuck_calls": stuck}

    def _log_samples(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Sampled conversations, env errors and external-call latencies to rank 0's logs;
        returns the latency metrics (on rank 0)."""
        k = self.cfg.trainer.log_samples
        errors = [{"error": s.env_error, "source": s.source, "messages": s.messages} for s in samples if s.env_error]
        counts: dict[str | None, int] = {}  # samples per source, for the env error warning
        for s in samples:
            counts[s.source] = counts.get(s.source, 0) + 1
        shown = [{"messages": s.messages, "answer": s.answer, "source": s.source, "reward": s.reward,
                  "finish_reason": s.finish_reason,
                  "n_turns": s.n_turns, "turn_versions": s.turn_versions, "events": s.events} for s in samples[:k]]
        calls = self.rollout.pop_api_calls()
        gathered = gather_to_main({"errors": errors, "samples": shown, "calls": calls, "counts": counts}, self.ctx)
        if gathered is None:
            return {}
        self._note_env_errors(step, gathered)
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

    def _note_env_errors(self, step: int, gathered: list[dict]) -> None:
        """(rank 0) A warning when every sample of a source (or of the step, without sources) ended in an
        env error, naming the source, its env file and the first error; once per streak of such steps."""
        counts: dict[str | None, int] = {}
        failed: dict[str | None, list[str]] = {}
        for part in gathered:
            for source, n in part["counts"].items():
                counts[source] = counts.get(source, 0) + n
            for e in part["errors"]:
                failed.setdefault(e["source"], []).append(e["error"])
        self._all_env_errors = bool(counts) and sum(map(len, failed.values())) == sum(counts.values())
        for source, n in counts.items():
            if len(failed.get(source, ())) < n:
                self._env_failing.discard(source)  # the streak ends: warn again if it comes back
                continue
            if source in self._env_failing:
                continue
            self._env_failing.add(source)
            paths = env_paths(self.cfg)
            env = paths if isinstance(paths, str) else paths.get(source, self.env.name)
            first = failed[source][0]
            first = first if len(first) <= 300 else first[:300] + " ..."
            whose = f"the {n} samples from source '{source}'" if source is not None else f"its {n} samples"
            metric = f"env/errors/{source}" if source is not None else "env/errors"
            self._warn(step, f"step {step}: every one of {whose} ended in an env error in {env} (each scored "
                             f"rollout.env_error_reward={self.cfg.rollout.env_error_reward:g}); the first: {first}; "
                             f"see {metric} and the env_error events in trajectories.jsonl (warned again only after "
                             "a step where some succeed)")

    def _count_outcome(self, metrics: dict[str, float]) -> None:
        """Count why this step changed no actor weight, or that it did (the run's closing line)."""
        if self._all_env_errors:  # (known on rank 0, the one that prints)
            outcome = "env_errors"
        elif metrics.get("actor/skipped"):
            outcome = "skipped"
        elif metrics.get("governor/rollback"):
            outcome = "rolled_back"
        elif metrics.get("actor/frozen"):
            outcome = "frozen"
        else:
            outcome = "updated"
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _no_update_causes(self) -> str:
        """The closing line's reasons, counted over this launch's steps."""
        said = {"env_errors": "every sample an env error (the env warning above, env/errors, env_error events in "
                              "trajectories.jsonl)",
                "skipped": "skipped: every group's rewards were identical, so dynamic filtering dropped them all "
                           "(actor/skipped)",
                "rolled_back": "rolled back by the governor (the 'governor rolled back' lines above, "
                               "governor/rollback)",
                "frozen": f"frozen by actor.freeze_steps={self.cfg.actor.freeze_steps}"}
        return "; ".join(f"{n} step(s) {said[why]}" for why, n in self.outcomes.items() if why in said)

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """`rewards/test` over the whole test set, and `rewards/test/<source>` for each of its sources."""
        ctx = self.ctx
        self.engine.wake()
        rows = self.test_rows[ctx.rank::ctx.world_size]
        samples, _ = self.rollout.rollout(rows, 1, self.test_sampling, sample_seed(self.test_seed, -1, ctx.rank),
                                          what=f"step {step}'s evaluation")
        skipped = [s for s in samples if s.finish_reason == PROMPT_TOO_LONG]  # prompts that fill the context
        samples = [s for s in samples if s.finish_reason != PROMPT_TOO_LONG]
        total, count, errors, n_skipped, *by_source = all_reduce_sum(
            [sum(s.reward for s in samples), float(len(samples)), float(sum(bool(s.env_error) for s in samples)),
             float(len(skipped)), *per_source_sums(samples, self.test_sources, lambda s: float(bool(s.env_error)))],
            ctx.device)
        if n_skipped:
            self._prompt_overflows(step, skipped, 1)
        score = total / max(count, 1.0)
        self.test_history.append((step, score))
        out = {"rewards/test": score}
        for source, (reward_sum, n, _) in zip(self.test_sources, split_triples(by_source)):
            if n > 0:
                out[f"rewards/test/{source}"] = reward_sum / n
        self.log.event("eval", step, {**out, "n": count, "env_errors": errors})
        return out

    # -- the loop --------------------------------------------------------------------------
    def fit(self, stop: StopRequest | None = None) -> None:
        """Train to `total_steps`, then export; with `stop`, a SIGTERM / SIGINT ends the run at the
        next step boundary with a checkpoint (`trainer.save_on_signal`) and no export."""
        cfg = self.cfg
        test_freq, save_freq = cfg.trainer.test_freq, cfg.trainer.save_freq
        if test_freq and self.start_step == 0:
            scores = self.evaluate(0)
            self.log.log_metrics(0, scores)
            self.log.write(f"step 0: {test_line(scores)}")
        for step in range(self.start_step + 1, self.total_steps + 1):
            if isinstance(self.engine, RemoteEngine):  # names the step's push in a bridge error (rollout.ranks)
                self.engine.step = step
            eval_due = bool(test_freq and (step % test_freq == 0 or step == self.total_steps))
            metrics = self.train_step(step, boundary=eval_due or step == self.total_steps)
            self._count_outcome(metrics)
            if eval_due:
                t = time.perf_counter()
                with self.watchdog.phase("evaluation"):
                    scores = self.evaluate(step)
                metrics.update(scores)
                metrics["time/eval_s"] = time.perf_counter() - t
                self.log.write(f"step {step}: {test_line(scores)}")
            self.checkpointer.poll()  # an asynchronous save that has finished writing becomes `latest`
            save_due = bool(save_freq and step % save_freq == 0)
            if save_due:
                with self.watchdog.phase("checkpoint"):
                    metrics["time/checkpoint_s"] = self.save(step)
            self.log.log_metrics(step, metrics)
            self.log.progress(step, metrics)
            requested = stop.agreed(self.ctx.device) if stop is not None else None
            if requested:
                self._stop(step, requested, saved=save_due)
                return
        self.checkpointer.wait()
        export_hf(self.actor.model, self.tokenizer, os.path.join(cfg.trainer.save_dir, "latest"), self.ctx,
                  shard_bytes=int(cfg.trainer.export_shard_gb * GB), bucket_bytes=self.sync.bucket_bytes,
                  critic=self.critic.model if self.critic is not None else None,
                  base_model=hub.export_name(cfg.actor.model_name, self.paths.actor))
        # (a run frozen throughout, actor.freeze_steps, meant its actor to stay as it was: no line)
        if not self.outcomes.get("updated") and set(self.outcomes) - {"frozen"}:
            self.log.write(f"warning: this run made no update in its {self.total_steps - self.start_step} steps: "
                           f"nothing was learned ({self._no_update_causes()})")
        if len(self.test_history) >= 2:
            (s0, first), (s1, last) = self.test_history[0], self.test_history[-1]
            self.log.write(f"test reward: {first:.3f} (step {s0}) -> {last:.3f} (step {s1}), {last - first:+.3f}")
        elif not test_freq:
            self.log.write("evaluation off (trainer.test_freq=null)")

    def _stop(self, step: int, signal_name: str, saved: bool) -> None:
        """A requested stop after `step`: its checkpoint (complete before returning), one line saying
        how to resume."""
        cfg = self.cfg
        if cfg.trainer.save_on_signal and not saved:
            self.save(step)
        self.checkpointer.wait()
        latest = ckpt.find_latest(cfg.trainer.save_dir)
        self.log.event("stopped", step, {"signal": signal_name, "checkpoint": latest})
        if latest is not None:
            how = f"resume with trainer.load_ckpt_from=latest (checkpoint {latest})"
        else:
            how = "no checkpoint was saved (trainer.save_on_signal=false): a restart begins again"
        self.log.write(f"stopped by {signal_name} after step {step}; {how}")

    def close(self) -> None:
        idle = self.prefetch.close() if self.prefetch is not None else True
        self.watchdog.close()
        self.checkpointer.close()
        self.log.close()
        if idle:  # (a rollout still running holds the worker's event loop: the process ends with it)
            self.rollout.close()
        if self.run_folder is not None:
            self.run_folder.close()


def run(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()  # our own bar is the one to watch
    stop = StopRequest()
    stop.install()
    ranks = rollout_ranks(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_distributed(collective_timeout_s(cfg), ranks, cfg.rollout.async_timeout_s)
    try:
        if ctx.is_rollout_rank:  # rollout.ranks > 0: this rank only generates and scores, for the trainer ranks
            serve(cfg, ctx)
            return
        trainer = Trainer(cfg, ctx)
        try:
            trainer.fit(stop)
        finally:
            trainer.close()
    finally:
        stop.uninstall()
        cleanup()


# Mistakes a user can fix (config, data, env module, chat template): one clear line, no traceback.
USER_ERRORS = (ConfigError, DataError, EnvLoadError, TokenizationError, ckpt.CheckpointError, ModelWeightsError,
               RunFolderError, LoraTargetError)


@hydra.main(config_path="../../config", config_name="grpo", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except USER_ERRORS as e:
        fail(f"error: {e}", 2, every_rank=False)
    except (WeightSyncError, StorageError, RolloutTimeout, BridgeError) as e:  # each rank says what its own engine / disk holds
        fail(f"error: rank {os.environ.get('RANK', '0')}: {e}", 4)
    except OSError as e:
        if e.errno in UNWRITABLE_ERRNOS and is_under(e.filename, cfg.trainer.save_dir):  # (read-only since start-up)
            fail(f"error: rank {os.environ.get('RANK', '0')}: "
                 f"{unwritable_line(e, 'into the run folder', cfg.trainer.save_dir)}", 4)
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        fail(f"error: rank {os.environ.get('RANK', '0')}: no space left on the device holding "
             f"{e.filename or cfg.trainer.save_dir}: free some space or point trainer.save_dir at a larger disk; "
             "trainer.load_ckpt_from=latest resumes from the newest complete checkpoint", 4)


def fail(line: str, code: int, every_rank: bool = True) -> NoReturn:
    """Print `line` (on rank 0 only unless `every_rank`), hand it to torchrun's failure report
    (every rank, so the report names it whichever rank it calls the root cause) and exit."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    record_for_torchrun(line)
    sys.exit(code)


if __name__ == "__main__":
    sys.argv = sys.argv[:1] + quote_values_with_equals(sys.argv[1:])
    main()
