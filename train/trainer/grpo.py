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
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
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

from train.datasets.curriculum import Curriculum
from train.datasets.dataloader import build_dataloader
from train.datasets.loading import DataError
from train.datasets.mixture import load_sources, mixture_shares, source_names
from train.datasets.tokenize import TokenizationError, encode
from train.datasets.vision import vision_processor
from train.engines import build_engine
from train.models.actor import Actor, AdapterFreeReference
from train.models.critic import Critic
from train.models.config import ActorConfig, compute_dtype
from train.models.lora import LoraTargetError
from train.models.memory_plan import resident_bytes
from train.models.model_init import ModelWeightsError
from train.models.router_replay import dispatch_routes
from train.models.shared_base import engine_model_over, share_base_refusal
from train.parallel.collectives import broadcast_from_main
from train.parallel.distributed import DistContext, cleanup, init_distributed, set_cpu_threads
from train.parallel.layout import Layout, layout_for
from train.parallel.parallelize import DTYPES
from train.parallel.rollout_bridge import BridgeError
from train.parallel.step_batch import BatchIndex, StepBatch, dispatch, exchange_index, transfer
from train.runtime import checkpoint as ckpt
from train.runtime.export import GB, export_hf
from train.runtime.lifecycle import StopRequest
from train.runtime.logging import RunLogger, test_line
from train.runtime.run_folder import RunFolderError, claim
from train.runtime.device_memory import phase_peak
from train.runtime.watchdog import Watchdog
from train.trainer.advantages import compute_advantages
from train.trainer.config import (ConfigError, ModelPaths, collective_timeout_s, data_sources, has_reference_slot,
                                  quote_values_with_equals, resolve_aliases, role_config, rollout_ranks,
                                  sampling_params, useless_settings, validate)
from train.trainer.data_check import PromptOverflowLog, check_data, context_length
from train.trainer.drift import StartDrift
from train.trainer.engine_sleep import EngineSleep
from train.trainer.evaluation import Evaluator, SampledEval
from train.trainer.forgetting import ForgettingGate
from train.trainer.governor import Governor
from train.trainer.health import HealthDetector
from train.trainer.policy_sync import PolicySync
from train.trainer.prefetch import RolloutTimeout, StepRollout
from train.trainer.report import RunReport
from train.trainer.schema import load
from train.trainer.inflight import read_saved_rank
from train.trainer.sources import rollout_source
from train.trainer.teachers import RoutedTeachers, TeacherRoutes
from train.trainer.step import RunningMoments
from train.trainer.sync_check import PROBE_TEXT, SyncProbe, WeightSyncError, probe_tolerance
from train.utils import hub
from train.utils.disk import UNWRITABLE_ERRNOS, StorageError, is_under, unwritable_line
from train.utils.torchrun_errors import record_for_torchrun
from train.workers.config import RolloutConfig
from train.workers.env_routing import EnvRouter, env_paths
from train.workers.environment import EnvLoadError
from train.workers.remote_rollout import RemoteEngine, RemoteRollout
from train.workers.rollout import RolloutWorker, Sample
from train.workers.rollout_server import serve


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def reference_folders(paths: ModelPaths, teacher_folders: list[str], *, reference_slot: bool, lora: bool) -> list[str]:
    """The folders of the frozen models the run loads besides the actor: each teacher (distill.teachers), or the
    model of the reference slot (`reference_slot`: a KL reference or a distillation teacher); none when a LoRA
    actor's (`lora`) reference is its own base, the actor with its adapters off."""
    if paths.teachers:
        return list(teacher_folders)
    same_base = os.path.realpath(paths.reference) == os.path.realpath(paths.actor)
    return [paths.reference] if reference_slot and not (lora and same_base) else []


def resident_elsewhere(frozen_folders: list[str], critic_folder: str | None, shards: Callable[[str], int],
                       dtype: str = "float32") -> int:
    """Device bytes per rank that the run's other models keep while the actor updates (its null memory settings
    leave room for them, train/models/memory_plan.py): the frozen ones (`reference_folders`, their weights held
    in the run's `dtype`, actor.dtype) and the critic (trained; PPO). `shards(role)`: the FSDP ranks that role's
    model is split over."""
    from transformers import AutoConfig

    held = sum(resident_bytes(AutoConfig.from_pretrained(f), trainable=False, shards=shards("ref_actor"),
                              weight_bytes=DTYPES[dtype].itemsize) for f in frozen_folders)
    if critic_folder is not None:
        held += resident_bytes(AutoConfig.from_pretrained(critic_folder), trainable=True, shards=shards("critic"),
                               value_head=True)
    return held


def awake_engine_bytes(rollout: RolloutConfig, device_type: str, rollout_folder: str,
                       borrows: bool) -> Callable[[], int] | None:
    """Where this rank's `hf` engine stays awake through the actor's update by the configuration (rollout.sleep
    =false, or rollout.max_staleness >= 1: it generates meanwhile), what says its own weights' device bytes (0
    where it `borrows` the actor's, rollout.share_actor_base); None where it sleeps when the update needs its
    memory, runs on rollout ranks, or is SGLang (its KV pool is rollout.gpu_memory_utilization of the card)."""
    if rollout.engine != "hf" or rollout.ranks or not (rollout.sleep is False or rollout.max_staleness >= 1):
        return None
    if borrows:
        return lambda: 0
    from transformers import AutoConfig

    itemsize = DTYPES[compute_dtype(rollout.dtype, device_type)].itemsize
    return lambda: resident_bytes(AutoConfig.from_pretrained(rollout_folder), trainable=False, weight_bytes=itemsize)


def plans_on_borrowing(refusal: str | None, rollout: RolloutConfig, actor: ActorConfig) -> bool:
    """Whether the actor may plan its memory as if an awake engine borrows its weights (`awake_engine_bytes`):
    nothing refuses it (`refusal`: shared_base.share_base_refusal), rollout.share_actor_base is not false, and a
    full fine-tune has its masters set on. Null masters are decided after the memory settings and may come out
    off, and then the engine keeps its own copy: the plan counts it."""
    return (refusal is None and rollout.share_actor_base is not False
            and (actor.lora.rank > 0 or actor.master_weights is True))


@dataclass
class Models:
    """The models of a step: the actor, its KL reference or distillation teacher(s) (None without either),
    the critic (PPO)."""
    actor: Actor
    ref: Actor | AdapterFreeReference | RoutedTeachers | None
    critic: Critic | None

    @property
    def trained(self) -> dict:
        """What an update changes, by name: checkpoints and the governor's snapshots hold their state."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}


class Trainer:
    """One run: its parts, built from the config, and the step loop (`fit`, `train_step`)."""

    def __init__(self, given: DictConfig, ctx: DistContext):
        resolve_aliases(given)
        timeout = given.trainer.model_fetch_timeout_s
        # Before anything heavy loads; Hub models are fetched once per node here.
        self.paths = paths = validate(given, ctx.world_size, device_type=ctx.device.type,
                                      resolve=lambda names: hub.resolve_on_node(names, ctx.local_rank, timeout))
        # From here on the typed sections (train/trainer/schema.py); each part receives its own.
        self.cfg, self.ctx = cfg, ctx = load(given), ctx
        # The folder is this run's (or the resumed run's) before anything loads or is written into it.
        self.run_folder, moved = claim(cfg.trainer.save_dir, cfg.trainer.load_ckpt_from, cfg.trainer.overwrite, ctx)
        set_cpu_threads(ctx, cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed, ctx.rank)
        # distill.teacher / distill.teachers: which teacher scores each data source's samples
        self.teacher_routes = (TeacherRoutes.of(paths.reference if cfg.distill.teacher is not None else None,
                                                paths.teachers) if cfg.distill.enabled else None)

        self.tokenizer = AutoTokenizer.from_pretrained(paths.tokenizer)
        # The engine's tokenizer (templating prompts, decoding replies): the same vocabulary (checked).
        rollout_tokenizer = (self.tokenizer if paths.rollout_tokenizer == paths.tokenizer
                             else AutoTokenizer.from_pretrained(paths.rollout_tokenizer))
        if cfg.actor.chat_template:
            self.tokenizer.chat_template = rollout_tokenizer.chat_template = cfg.actor.chat_template
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        # A vision-language actor's image processing (train/datasets/vision.py), with data.*_pixels; None for text.
        # The rollout worker keeps it (`vision_of`).
        vision = vision_processor(paths.actor, rollout_tokenizer, cfg.data)
        # Each row's environment: one for all, or one per data source (rollout.env_path as a mapping).
        env = EnvRouter(env_paths(cfg.rollout), timeout_s=cfg.rollout.env_timeout_s,
                        max_workers=cfg.rollout.env_workers, max_turns=cfg.rollout.max_turns)
        train_sources, test_sources = data_sources(cfg.data)
        train_rows = load_sources(train_sources)
        test_rows = load_sources(test_sources) if cfg.trainer.test_freq else []
        # The conversation limit, from the config (rollout.max_total_length) or the model's, before any model loads.
        context = context_length(cfg.rollout.max_total_length, paths.actor)
        found = self._check_data(train_rows, test_rows, env, rollout_tokenizer, context, vision)
        # Per-prompt pass rates, kept in every run; a policy other than uniform also decides what is drawn.
        curriculum = Curriculum(cfg.data.curriculum, train_rows, cfg.trainer.seed)
        accept = curriculum.accept if cfg.data.curriculum.policy != "uniform" else None
        loader = build_dataloader(train_rows, batch_size=cfg.data.prompts_per_rollout // ctx.world_size,
                                  rank=ctx.rank, world_size=ctx.world_size, seed=cfg.trainer.seed,
                                  shuffle=cfg.data.shuffle, accept=accept, **mixture_shares(train_sources, train_rows))
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.n_epochs * loader.batches_per_epoch
        train_sampling = sampling_params(cfg.rollout, "train_sampling_params")
        test_sampling = sampling_params(cfg.rollout, "test_sampling_params")
        temperature = train_sampling.temperature or 1.0
        self.models = self._build_models(pad_id, temperature)
        gov = cfg.trainer.governor
        governor = (Governor(gov.watch, gov.window, gov.k_sigma, gov.min_history, gov.min_panics,
                             gov.rel_std_floor, gov.max_weight_change) if gov.enable else None)
        self.engine, rollout = self._build_rollout(env, rollout_tokenizer, context.tokens, vision)
        self.checkpointer = ckpt.Checkpointer(cfg.trainer.save_dir, ctx, async_save=cfg.trainer.async_save,
                                              keep_last_n=cfg.trainer.keep_last_n)
        saved = self._load_checkpoint()
        self.start_step = saved[0]["step"] if saved is not None else 0
        self.trainer_version = self.start_step  # the step whose update made the actor's weights
        self.engine.weight_version = self.start_step
        self.log = RunLogger(cfg.trainer, given, ctx.is_main, self.total_steps, self.start_step)
        self.report = RunReport(self.log, ctx, env_files=env_paths(cfg.rollout), env_name=env.name,
                                env_error_reward=cfg.rollout.env_error_reward, log_samples=cfg.trainer.log_samples,
                                warn_skipped_steps=cfg.trainer.warn_skipped_steps,
                                freeze_steps=cfg.actor.freeze_steps, overlong_prompts=cfg.data.overlong_prompts,
                                # rows skipped at rollout time, named on rank 0 (those named at start-up only counted)
                                prompt_overflows=PromptOverflowLog(context, found.overlong_rows))
        self.watchdog = Watchdog(cfg.trainer.watchdog_min_s, cfg.trainer.watchdog_factor, ctx.rank,
                                 cfg.trainer.save_dir, describe=env.longest_call)
        # Request seeds derive from (base seed, step, sample): sampling_params.seed, else trainer.seed.
        seed_of = lambda sampling: cfg.trainer.seed if sampling.seed is None else sampling.seed  # noqa: E731
        sampled = (SampledEval(cfg.trainer.test_samples, tuple(cfg.trainer.test_pass_k), cfg.trainer.test_temperature,
                               cfg.data.curriculum.pass_threshold) if cfg.trainer.test_samples else None)
        # kl_to_start/test on the sampled replies, where the run holds its starting policy (train/trainer/drift.py)
        drift = StartDrift.of(self.models.actor, self.models.ref, actor_path=paths.actor, ref_path=paths.reference,
                              distill=cfg.distill.enabled, ctx=ctx, vision=vision is not None) if sampled else None
        self.evaluate = Evaluator(ctx, rows=test_rows, sources=source_names(test_rows), rollout=rollout,
                                  engine=self.engine, sampling=test_sampling, seed=seed_of(test_sampling),
                                  report=self.report, sampled=sampled, drift=drift)
        # Where each step's samples come from: made now, or ahead with rollout.max_staleness (rollouts.py).
        self.rollouts = rollout_source(cfg.rollout, cfg.data, ctx, total_steps=self.total_steps, watchdog=self.watchdog, loader=loader,
                                       rollout=rollout, engine=self.engine, sampling=train_sampling,
                                       seed=seed_of(train_sampling), curriculum=curriculum, report=self.report,
                                       sources=source_names(train_rows),
                                       engine_sleep=EngineSleep.of(cfg.rollout.sleep, ctx, "remote" if ctx.bridge is not None
                                                                   else cfg.rollout.engine, self.models.actor,
                                                                   self.models.critic))
        # What a checkpoint holds besides the models, by name (each has state_dict / load_state_dict).
        health = HealthDetector.from_config(cfg.trainer.health)
        forgetting = ForgettingGate.from_config(cfg.trainer.forgetting)
        guards = {"health": health, "forgetting": forgetting}
        self.state = {"test_history": self.evaluate, "reward_moments": RunningMoments(),
                      **({"governor": governor} if governor is not None else {}), "curriculum": curriculum,
                      **{k: v for k, v in guards.items() if v is not None}, "dataloader": loader}
        if saved is not None:
            self._restore(*saved)
        if moved:
            self.log.write(f"trainer.overwrite: the run that was in {cfg.trainer.save_dir} is now in {moved}")
        for warning in useless_settings(given) + found.warnings:  # (contamination, prompts that fill the context)
            self.report.warn(self.start_step, warning)
        self.sync = PolicySync(self.models.actor.model, self.engine, cfg.rollout.bucket_size_mb, governor,
                               self.models.trained, self.log, verify=cfg.trainer.verify_push, watchdog=self.watchdog,
                               push_timeout_s=cfg.rollout.push_timeout_s, device=ctx.device, rank=ctx.rank,
                               health=health, forgetting=forgetting)
        # The sync probe: a fixed sequence both sides score (trainer.sync_probe_every).
        self.probe = SyncProbe(encode(rollout_tokenizer, PROBE_TEXT), cfg.trainer.sync_probe_every,
                               probe_tolerance(cfg.trainer.sync_probe_tol, getattr(self.engine, "dtype", torch.float32),
                                               cfg.actor.dtype), temperature)
        if (saved is not None or self.models.actor.lora.enabled
                or os.path.realpath(paths.rollout) != os.path.realpath(paths.actor)):
            # the engine loaded rollout.model_name (or the run's start, or fresh adapters): sample from the actor
            self.sync.push(self.start_step)
        self._log_layouts()

    # -- building the parts ----------------------------------------------------------------
    def vision_of(self):
        """The rollout's VisionProcessor (a vision-language actor), else None."""
        return getattr(self.rollouts.rollout, "vision", None)

    def _check_data(self, train_rows: list[dict], test_rows: list[dict], env: EnvRouter, tokenizer, context, vision):
        """Rank 0 checks the data (train/trainer/data_check.py: sources routed, contamination, which hashes
        the training n-grams, the first data.check_rows prompts' lengths); every rank gets the outcome."""
        try:
            found = (check_data(self.cfg.data, train_rows, test_rows, env.routes, tokenizer, context, vision)
                     if self.ctx.is_main else None)
        except DataError as e:
            found = f"{e}"
        found = broadcast_from_main(found, self.ctx)
        if isinstance(found, str):
            raise DataError(found)
        return found

    def _build_models(self, pad_id: int, temperature: float) -> Models:
        cfg, ctx, paths = self.cfg, self.ctx, self.paths
        layouts: dict[tuple[int, ...], Layout] = {}

        def layout(role: str) -> Layout:  # models with the same sizes share their meshes (one set of groups)
            section = role_config(cfg, role)
            key = tuple(getattr(section, k, None) or 1 for k in ("ddp_size", "tp_size", "sp_size", "ep_size", "cp_size"))
            if key not in layouts:
                layouts[key] = layout_for(section, ctx.world_size, ctx.device.type, role,
                                          timeout_s=ctx.collective_timeout_s)
            return layouts[key]

        updates = self.total_steps * cfg.actor.update_per_rollout * cfg.actor.mini_batches
        # decided once: the reserve the actor leaves for them and the models built below
        frozen_folders = reference_folders(paths, self.teacher_routes.folders if paths.teachers else [],
                                           reference_slot=has_reference_slot(cfg), lora=cfg.actor.lora.rank > 0)
        critic_folder = paths.critic if cfg.adv.estimator == "gae" else None
        # the engine borrows the actor's weights (rollout.share_actor_base) where the config lets it
        borrows = plans_on_borrowing(share_base_refusal(cfg, ctx.world_size, ctx.device.type), cfg.rollout, cfg.actor)
        others = lambda: resident_elsewhere(frozen_folders, critic_folder,  # noqa: E731
                                            lambda role: layout(role).sizes.fsdp, cfg.actor.dtype)
        actor = Actor(cfg.actor, ctx, paths.actor, pad_token_id=pad_id, train=True, temperature=temperature,
                      total_updates=updates, layout=layout("actor"), adapter_seed=cfg.trainer.seed, reserved_bytes=others,
                      awake_engine_bytes=awake_engine_bytes(cfg.rollout, ctx.device.type, paths.rollout, borrows))
        if actor.cfg is not cfg.actor:  # null memory settings decided by the actor: the reference runs with them too
            cfg = self.cfg = replace(cfg, actor=actor.cfg)
        ref = None

        def frozen(folder: str) -> Actor:  # a model of the reference slot
            return Actor(role_config(cfg, "ref_actor"), ctx, folder, pad_token_id=pad_id, train=False,
                         temperature=temperature, layout=layout("ref_actor"))

        if paths.teachers:  # distill.teachers: a teacher per data source, each scoring its samples
            ref = RoutedTeachers([frozen(folder) for folder in frozen_folders])
        elif frozen_folders:  # the KL reference, or the distillation teacher (paths.reference)
            ref = frozen(frozen_folders[0])
        elif has_reference_slot(cfg):  # a LoRA actor on its own base: the base is the actor with its adapters off
            ref = AdapterFreeReference(actor)
        critic = None
        if critic_folder is not None:
            critic_updates = self.total_steps * cfg.critic.update_per_rollout * cfg.critic.mini_batches
            critic = Critic(cfg.critic, ctx, critic_folder, pad_token_id=pad_id, total_updates=critic_updates,
                            layout=layout("critic"), adapter_seed=cfg.trainer.seed)
        return Models(actor, ref, critic)

    def _build_rollout(self, env: EnvRouter, tokenizer, max_len: int, vision=None):
        """The engine and the rollout worker: in this process, or a dedicated rollout rank's (rollout.ranks)."""
        cfg, ctx, paths = self.cfg, self.ctx, self.paths
        if ctx.bridge is not None:  # rollout.ranks > 0: a dedicated rollout rank generates and scores for this rank
            engine = RemoteEngine(ctx.bridge, ctx.rank, max(1, int(cfg.rollout.bucket_size_mb * (1 << 20))))
            names = {"model_name": cfg.rollout.model_name or cfg.actor.model_name,
                     "tokenizer_name": cfg.rollout.tokenizer_name or cfg.actor.tokenizer_name or cfg.actor.model_name}
            return engine, RemoteRollout(engine, {"model": paths.rollout, "tokenizer": paths.rollout_tokenizer,
                                                  "max_total_length": max_len,
                                                  "record_routing": bool(cfg.actor.router_replay), **names})
        actor = self.models.actor
        lora = actor.lora if actor.lora.enabled else None
        shared, borrowed = None, ()
        why = share_base_refusal(cfg, ctx.world_size, ctx.device.type, actor_masters=actor.masters is not None,
                                 paths=paths)
        if why is None and cfg.rollout.share_actor_base is not False:  # no second copy of the actor's weights
            shared, borrowed = engine_model_over(actor.model, actor.lora)
        elif why is not None and cfg.rollout.share_actor_base:
            raise ConfigError(f"rollout.share_actor_base=true cannot apply: {why} (e.g. rollout.share_actor_base=null)")
        engine = build_engine(cfg.rollout, ctx, model_path=paths.rollout, tokenizer=tokenizer,
                              seed=cfg.trainer.seed, lora=lora, model=shared, borrowed=tuple(borrowed),
                              record_routing=bool(cfg.actor.router_replay))
        return engine, RolloutWorker(engine, env, tokenizer, max_turns=cfg.rollout.max_turns,
                                     env_error_reward=cfg.rollout.env_error_reward, max_total_length=max_len,
                                     max_env_chars=cfg.rollout.max_env_chars, vision=vision)

    def _log_layouts(self) -> None:
        """One line (and a `layout` event) saying how each model is laid out on the ranks."""
        m = self.models
        # a LoRA actor's reference is the actor itself (adapters off): no model of its own to lay out
        ref = None if isinstance(m.ref, AdapterFreeReference) else m.ref
        models = {"actor": m.actor, "ref_actor": ref, "critic": m.critic}
        layouts = {role: vars(model.layout.sizes) for role, model in models.items() if model is not None}
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
        if m.actor.memory_note:
            self.log.write(f"actor memory settings: {m.actor.memory_note}")
        held = [role for role, worker in m.trained.items() if worker.masters is not None]
        if held:  # one process in bf16: which models keep fp32 masters instead of FSDP2's mixed precision
            self.log.write(f"{' and '.join(held)}: bf16 weights with fp32 masters, cast once per optimizer step "
                           "(actor.master_weights / critic.master_weights)")
        borrowed = len(getattr(self.engine, "borrowed", ()))
        if borrowed and not m.actor.lora.enabled:
            self.log.write(f"the rollout engine reads the actor's bf16 weights (rollout.share_actor_base: {borrowed} "
                           "tensors not copied; a push moves nothing)")
        for role, worker in m.trained.items():
            if worker.lora.enabled:
                trainable, total = worker.parameter_counts()
                base_ref = worker is m.actor and ref is not m.ref
                reference = "; KL reference: the base (adapters off)" if base_ref else ""
                shared = ("; the rollout engine uses the actor's frozen base (rollout.share_actor_base: "
                          f"{borrowed} tensors not copied)") if worker is m.actor and borrowed else ""
                self.log.write(f"{role}: LoRA rank {worker.lora.rank} (alpha {worker.lora.alpha:g}) on "
                               f"{', '.join(worker.lora.target_modules)}: {trainable / 1e6:.3g}M trainable "
                               f"parameters of {total / 1e6:.4g}M{reference}{shared}")

    # -- checkpoints -----------------------------------------------------------------------
    def _load_checkpoint(self) -> tuple[dict, dict | None] | None:
        """The models restored from the checkpoint asked for, and its (state, this rank's state); None
        for a fresh start (also `latest` with nothing saved yet: restart-on-preemption loops)."""
        source = self.cfg.trainer.load_ckpt_from
        if source is None:
            return None
        path = ckpt.find_latest(self.cfg.trainer.save_dir) if source == "latest" else source
        if path is None:
            return None
        return self.checkpointer.load(path, self.models.trained)

    def _restore(self, state: dict, rank_state: dict | None) -> None:
        """The run's state parts, the rollouts it had made ahead, and this rank's random state."""
        for name, part in self.state.items():
            if name in state:
                part.load_state_dict(state[name])  # the loader's is global: any world size resumes at the same prompts
        pending = state.get("pending_rollout")  # an asynchronous run's finished, untrained rollouts
        if pending is not None:
            mine = rank_state.get("pending_rollout") if rank_state is not None else None
            if isinstance(mine, StepRollout):  # saved before several could be pending
                mine = [mine]
            same = (pending["world_size"] == self.ctx.world_size
                    and pending.get("max_staleness", 1) == self.cfg.rollout.max_staleness)
            if not (same and mine and self.rollouts.restore(mine)):
                # another world size or staleness, or a synchronous resume: those prompts are rolled out again
                self.state["dataloader"].load_state_dict(pending["loader_before"])
        inflight = state.get("inflight")  # an in-flight run's groups (rollout.inflight)
        if inflight is not None:
            mine = rank_state.get("inflight") if rank_state is not None else None
            self.rollouts.resume_inflight(inflight, mine, read_saved_rank(self.checkpointer.loaded_from))
        self._restore_replay(state.get("replay"), (rank_state or {}).get("replay"))
        self._favour_failing()  # as the gate last judged
        if rank_state is not None:
            ckpt.set_rng_state(rank_state["rng"])
        else:  # a rank the saving run did not have: a seed of its own, the same on every resume
            seed_everything(self.cfg.trainer.seed + 7919 * self.start_step, self.ctx.rank)

    def _restore_replay(self, shared: dict | None, mine: dict | None) -> None:
        """This rank's replay buffer (data.replay) as saved; another world size starts it empty (its groups were
        other ranks' samples), and says so."""
        replay = self.rollouts.replay
        if replay is None or shared is None:
            return
        if shared["world_size"] == self.ctx.world_size and mine is not None:
            replay.load_state_dict(mine)
        else:
            self.report.warn(self.start_step, f"data.replay: the checkpoint's buffer was saved by "
                             f"{shared['world_size']} ranks, this run has {self.ctx.world_size}: it starts empty")

    def save(self, step: int) -> float:
        """A checkpoint of `step` (train/runtime/checkpoint.py); the seconds the step loop waited."""
        start = time.perf_counter()
        state = {"step": step, **{name: part.state_dict() for name, part in self.state.items()}}
        if self.ctx.is_main:
            self.state["curriculum"].stats.dump(os.path.join(self.cfg.trainer.save_dir, "prompt_stats.jsonl"))
        rank_state = {"rng": ckpt.rng_state()}
        pending = self.rollouts.pending()
        if pending:  # generated with earlier weights: kept, not regenerated
            state["pending_rollout"] = {"steps": [p.step for p in pending], "world_size": self.ctx.world_size,
                                        "max_staleness": self.cfg.rollout.max_staleness,
                                        "loader_before": pending[0].loader_before}
            rank_state["pending_rollout"] = pending
        inflight = self.rollouts.inflight_state()
        if inflight is not None:  # groups in flight: their tokens, versions, log-probs and conversations
            state["inflight"], rank_state["inflight"] = inflight
        replay = self.rollouts.replay
        if replay is not None:  # this rank's past groups (data.replay)
            state["replay"], rank_state["replay"] = {"world_size": self.ctx.world_size}, replay.state_dict()
        path = self.checkpointer.save(step, self.models.trained, state, rank_state)
        self.log.event("checkpoint", step, {"path": path, "async": self.checkpointer.async_save})
        return time.perf_counter() - start

    # -- one step --------------------------------------------------------------------------
    def train_step(self, step: int, boundary: bool = True) -> dict[str, float]:
        """Rollout, update, push; with `boundary` (an evaluation or the run's end follows) nothing left in flight."""
        t0 = time.perf_counter()
        with self.watchdog.phase("rollout"), phase_peak(self.ctx.device, "rollout", peaks := {}):  # memory/*: CUDA
            got = self.rollouts.next(step, self.trainer_version)  # made now, made ahead, or on a rollout rank
        metrics = {**got.metrics, **peaks}
        self.rollouts.hand_over(step, metrics, sum(len(s.ids) for s in got.kept))  # next rollout starts, or engine sleeps
        metrics.update(self.report.samples(step, got.samples, self.rollouts.api_calls()))
        t1, n = time.perf_counter(), self.cfg.data.responses_per_prompt
        # Every rank learns every kept sample's length, group and reward (the step batch's index).
        routes = [self.teacher_routes.route(s.source) for s in got.kept] if self.teacher_routes else None
        index = exchange_index([len(s.ids) for s in got.kept], [i // n for i in range(len(got.kept))],
                               [s.shaped_reward for s in got.kept], self.ctx.device, routes=routes)
        metrics["batch/groups"] = index.size / n
        frozen, wait = step <= self.cfg.actor.freeze_steps, 0.0
        if index.size == 0:  # nothing to learn from on any rank: skip together, no collective left hanging
            metrics["actor/skipped"] = 1.0
            self.report.skipped(step)
        else:
            self.report.updated()
            with self.watchdog.phase("update"):
                metrics.update(self.update(step, index, got.kept, frozen))  # log-probs, advantages, optimizer steps
                wait = self.rollouts.before_push(metrics)  # a rollout in flight keeps the weights it started with
                with phase_peak(self.ctx.device, "push", metrics):
                    metrics.update(self.sync.after_update(step, metrics, push=not frozen))  # governor, push, verify
            pushed = not frozen and not metrics.get("governor/rollback")
            self.trainer_version = step if pushed else self.trainer_version
            if self.probe.due(step, pushed="time/weight_sync_s" in metrics):
                metrics["engine/probe_abs_diff"] = self.probe(self.engine, self.models.actor, step, self.ctx)
            self.rollouts.after_push()  # generation goes on (rollout.inflight), after the probe's use of the engine
        if boundary:  # an evaluation (it uses the engine) or the run's end follows
            wait += self.rollouts.settle(metrics)
        metrics["time/update_s"] = time.perf_counter() - t1 - metrics.get("time/weight_sync_s", 0.0) - wait
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def update(self, step: int, index: BatchIndex, kept: list[Sample], frozen: bool = False) -> dict[str, float]:
        """Dispatch the kept samples once per data layout, then every pass in place on the step batch:
        reference and old log-probs, values, advantages, the critic's and the actor's updates (the
        actor's not while `frozen`, actor.freeze_steps)."""
        cfg, device, m = self.cfg, self.ctx.device, self.models
        batches: dict[tuple[int, int], StepBatch] = {}

        def batch_for(model) -> StepBatch:  # models with the same data layout share one batch
            sizes = model.layout.sizes
            key = (sizes.dp, sizes.seq * sizes.tp)
            if key not in batches:
                replay = m.actor.replay if model is m.actor else None  # the sampler's experts (actor.router_replay)
                routes = {} if replay is None else dispatch_routes(kept, cfg.actor.router_replay, replay.spec)
                # asynchronous rollouts, replayed groups: each token's version gap, for actor/sampler_kl_lag{j}
                stale = cfg.rollout.max_staleness > 0 or cfg.data.replay.enable
                lags = [token_lags(s, self.trainer_version) for s in kept] if stale and model is m.actor else None
                batches[key] = dispatch(index, [s.ids for s in kept], [s.action_mask for s in kept],
                                        [s.sampler_logprobs for s in kept], model.layout, cfg.actor.mini_batches,
                                        device, share_prompt=cfg.actor.share_prompt, **routes,
                                        images=[s.images for s in kept] if self.vision_of() is not None else None,
                                        lags=lags)
            return batches[key]

        batch = batch_for(m.actor)
        peaks: dict[str, float] = {}
        if m.ref is not None:
            ref_batch = batch_for(m.ref)
            with phase_peak(device, "reference", peaks):
                ref_batch.fields["ref_logp"] = m.ref.compute_logprobs(ref_batch)
            transfer(ref_batch, batch, ["ref_logp"], device)
        if cfg.actor.update_per_rollout > 1 or cfg.actor.mini_batches > 1:
            batch.fields["old_logp"] = m.actor.compute_logprobs(batch)  # with one update the ratio is 1: skip
        scale = 1.0
        if m.critic is not None:
            critic_batch = batch_for(m.critic)
            critic_batch.fields["values"] = m.critic.compute_values(critic_batch)
            transfer(critic_batch, batch, ["values"], device)
            if cfg.critic.reward_norm:
                moments = self.state["reward_moments"]
                moments.update(index.reward)
                scale = 1.0 / (moments.std + 1e-8) if moments.count > 1 else 1.0
        kl = replace(cfg.actor.kl, coef=m.actor.kl_coef)  # (trainer.forgetting.action=raise_kl raises it)
        metrics = compute_advantages(batch, cfg.adv, kl, device, reward_scale=scale, distill=cfg.distill)
        metrics.update(peaks)
        if m.critic is not None:
            transfer(batch, critic_batch, ["returns"], device)
            metrics.update(m.critic.update(critic_batch))
        if frozen:
            metrics["actor/frozen"] = 1.0
            return metrics
        with phase_peak(device, "update", metrics):
            metrics.update(m.actor.update(batch, self.rollouts.sampling.max_new_tokens))
        if self.sync.governor is None:  # (the governor rolls such an update back itself)
            self.report.weight_change(step, metrics.get("actor/weight_change", 0.0),
                                      cfg.trainer.governor.max_weight_change)
        return metrics

    def evaluate_and_judge(self, step: int) -> dict[str, float]:
        """The evaluation's scores and the forgetting gate's verdict on them (trainer.forgetting)."""
        scores = self.evaluate(step)
        scores.update(self.sync.after_evaluation(step, scores))
        self._favour_failing()
        return scores

    def _favour_failing(self) -> None:
        """Adaptive replay: the sources whose held-out metric the forgetting gate saw fall (data.replay)."""
        gate, replay = self.state.get("forgetting"), self.rollouts.replay
        if gate is not None and replay is not None:
            replay.favour(gate.failing)

    # -- the loop --------------------------------------------------------------------------
    def fit(self, stop: StopRequest | None = None) -> None:
        """Train to `total_steps`, then export; with `stop`, a SIGTERM / SIGINT ends the run at the
        next step boundary with a checkpoint (`trainer.save_on_signal`) and no export."""
        cfg = self.cfg
        test_freq, save_freq = cfg.trainer.test_freq, cfg.trainer.save_freq
        if test_freq and self.start_step == 0:
            scores = self.evaluate_and_judge(0)  # (the forgetting gate's baselines)
            self.log.log_metrics(0, scores)
            self.log.write(f"step 0: {test_line(scores)}")
        for step in range(self.start_step + 1, self.total_steps + 1):
            if isinstance(self.engine, RemoteEngine):  # names the step's push in a bridge error (rollout.ranks)
                self.engine.step = step
            eval_due = bool(test_freq and (step % test_freq == 0 or step == self.total_steps))
            metrics = self.train_step(step, boundary=eval_due or step == self.total_steps)
            self.report.outcome(metrics)
            if eval_due:
                t = time.perf_counter()
                with self.watchdog.phase("evaluation"):
                    scores = self.evaluate_and_judge(step)
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
        critic = self.models.critic
        with ExitStack() as held:  # fp32 masters, where the models compute from bf16 casts of them
            actor_model = held.enter_context(self.models.actor.full_precision())
            critic_model = held.enter_context(critic.full_precision()) if critic is not None else None
            export_hf(actor_model, self.tokenizer, os.path.join(cfg.trainer.save_dir, "latest"), self.ctx,
                      shard_bytes=int(cfg.trainer.export_shard_gb * GB), bucket_bytes=self.sync.bucket_bytes,
                      critic=critic_model, base_model=hub.export_name(cfg.actor.model_name, self.paths.actor),
                      image_processor=self.vision_of().image_processor if self.vision_of() is not None else None)
        self.report.closing(self.total_steps - self.start_step)
        history = self.evaluate.history
        if len(history) >= 2:
            (s0, first), (s1, last) = history[0], history[-1]
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

    def close(self, failed: bool = False) -> None:
        """Release what the run holds. After a failure the rollouts in flight are not waited for (an env call may
        be what is stuck): the error line comes at once. A checkpoint being written still completes."""
        if failed:
            self.rollouts.close(wait_s=0.0)
        else:
            self.rollouts.close()  # RolloutSource's own wait for a rollout in flight
        self.watchdog.close()
        self.checkpointer.close()
        self.log.close()
        if self.run_folder is not None:
            self.run_folder.close()


def token_lags(sample: Sample, trainer_version: int) -> list[float]:
    """Per token of the sample: how many weight versions older than `trainer_version` its sampler was (-1 where
    nothing was sampled). A sample without per-token versions (kept by an older checkpoint) uses its turns'."""
    versions = getattr(sample, "token_versions", None) or []
    if len(versions) != len(sample.ids):
        oldest = min(sample.turn_versions, default=trainer_version)
        versions = [oldest if m else -1 for m in sample.action_mask]
    return [float(trainer_version - v) if v >= 0 else -1.0 for v in versions]


def run(cfg: DictConfig) -> None:
    transformers.utils.logging.disable_progress_bar()  # our own bar is the one to watch
    stop = StopRequest()
    stop.install()
    resolve_aliases(cfg)
    ranks = rollout_ranks(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_distributed(collective_timeout_s(cfg), ranks, cfg.rollout.async_timeout_s)
    try:
        if ctx.is_rollout_rank:  # rollout.ranks > 0: this rank only generates and scores, for the trainer ranks
            run_cfg = load(cfg)
            serve(run_cfg.rollout, ctx, chat_template=run_cfg.actor.chat_template, seed=run_cfg.trainer.seed,
                  num_threads=run_cfg.trainer.num_threads)
            return
        trainer = Trainer(cfg, ctx)
        failed = True
        try:
            trainer.fit(stop)
            failed = False
        finally:
            trainer.close(failed)
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
