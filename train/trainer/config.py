"""Config checks in one place: every bad or missing key fails before any model loads,
with the key's name and an example override.

The same checks before a launch, without torchrun (launch_grpo.sh runs this first), with the data
checks of train/trainer/data_check.py on the first `data.check_rows` rows of each data source:

    .venv/bin/python -m train.trainer.config --check --nproc 2 --config-name stub trainer.save_dir=runs/stub
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train.datasets.errors import DataError
from train.datasets.mixture import MixtureError, Source, load_sources, parse_sources
from train.engines import engine_sampling_keys
from train.engines.base import SamplingError, SamplingParams, sampling_from_mapping
from train.models.config import ActorConfig, CriticConfig, compute_dtype
from train.runtime.config import TrainerConfig
from train.workers.config import RolloutConfig, longest_sample
from train.trainer.data_check import check_data, context_length
from train.trainer.schema import RunConfig, load
from train.utils import hub
from train.utils.typed_config import ConfigError, build_field, fail as _fail, plain
from train.workers.env_routing import env_paths

__all__ = ["ConfigError", "ModelPaths", "validate", "load", "resolve_aliases", "role_config", "sampling_params"]


# Keys the user must choose, with an example override for the error message.
REQUIRED = {
    "data.train_data_path": "data.train_data_path=stub/data/math/train.jsonl",
    "data.prompts_per_rollout": "data.prompts_per_rollout=16",
    "actor.model_name": "actor.model_name=stub/model (a local folder or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct)",
    "rollout.env_path": "rollout.env_path=environments/eq.py",
    "trainer.save_dir": "trainer.save_dir=runs/my_run",
}

# Model and tokenizer names: a local folder or a Hugging Face Hub id (train/utils/hub.py).
MODEL_KEYS = {"actor.model_name": "model", "actor.tokenizer_name": "tokenizer", "ref_actor.model_name": "model",
              "critic.model_name": "model", "rollout.model_name": "model", "rollout.tokenizer_name": "tokenizer",
              "distill.teacher": "model"}
SAMPLING_SECTIONS = ("rollout.train_sampling_params", "rollout.test_sampling_params")


@dataclass(frozen=True)
class ModelPaths:
    """Local folders of every model and tokenizer a run loads, defaults filled in."""
    actor: str
    tokenizer: str  # the trainer's (actor.tokenizer_name, default the actor's folder)
    reference: str  # the KL reference's folder, or the teacher's (distill.teacher): the model in the reference slot
    critic: str
    rollout: str  # the engine's starting weights (rollout.model_name, default the actor's)
    rollout_tokenizer: str
    teachers: Mapping[str, str] = field(default_factory=dict)  # distill.teachers: data source -> teacher's folder

    @classmethod
    def from_resolved(cls, found: Mapping[str, str]) -> "ModelPaths":
        actor = found["actor.model_name"]
        tokenizer = found.get("actor.tokenizer_name", actor)
        reference = found.get("distill.teacher") or found.get("ref_actor.model_name", actor)
        prefix = "distill.teachers."
        return cls(actor=actor, tokenizer=tokenizer, reference=reference,
                   critic=found.get("critic.model_name", actor), rollout=found.get("rollout.model_name", actor),
                   rollout_tokenizer=found.get("rollout.tokenizer_name", tokenizer),
                   teachers={k[len(prefix):]: v for k, v in found.items() if k.startswith(prefix)})


def _get(cfg: DictConfig, key: str):
    return OmegaConf.select(cfg, key, default=None)


ASYNC_TIS_CAP = 2.0  # actor.tis_cap when rollout.max_staleness > 0 and none is given


def _validate_inflight(run) -> None:
    """rollout.inflight: the settings it needs and those it cannot serve."""
    rollout, data = run.rollout, run.data
    if rollout.max_staleness < 1:
        _fail("rollout.max_staleness", "must be >= 1 with rollout.inflight=true (the bound on each sample's oldest "
              "token when trained; the next segment always generates while the update runs)", "rollout.max_staleness=2")
    if rollout.inflight_groups is not None and rollout.inflight_groups < data.prompts_per_rollout:
        _fail("rollout.inflight_groups", f"{rollout.inflight_groups} is fewer than data.prompts_per_rollout="
              f"{data.prompts_per_rollout}: a step trains that many groups", f"rollout.inflight_groups="
              f"{2 * data.prompts_per_rollout}")
    sampling = rollout.train_sampling_params or {}
    longest = longest_sample(rollout, sampling.get("max_new_tokens", SamplingParams.max_new_tokens))
    if (rollout.over_stale == "requeue" and rollout.segment_tokens is not None
            and rollout.segment_tokens * rollout.max_staleness < longest):
        _fail("rollout.segment_tokens", f"{rollout.segment_tokens} x rollout.max_staleness={rollout.max_staleness} "
              f"tokens is less than a sample may sample ({longest}: max_new_tokens x max_turns): with "
              "rollout.over_stale=requeue a sample that long would be started again forever",
              f"rollout.segment_tokens={-(-longest // rollout.max_staleness)}")
    for key in ("presence_penalty", "frequency_penalty"):
        if sampling.get(key):
            _fail(f"rollout.train_sampling_params.{key}", "cannot be combined with rollout.inflight=true (a turn "
                  "continued in the next segment counts its earlier tokens as prompt)", "rollout.inflight=false")
    if sampling.get("stop"):
        _fail("rollout.train_sampling_params.stop", "stop strings cannot be combined with rollout.inflight=true (one "
              "could span a segment boundary); stop_token_ids can", "rollout.train_sampling_params.stop=[]")


def resolve_aliases(cfg: DictConfig) -> None:
    """Accept `adv.lambda` for the seed's `adv.lamda` (the same GAE lambda); a run given only
    `rollout.model_name` starts the actor from it too."""
    if _get(cfg, "actor.model_name") is None and _get(cfg, "rollout.model_name") is not None:
        cfg.actor.model_name = cfg.rollout.model_name
    staleness = _get(cfg, "rollout.max_staleness")
    stale = (isinstance(staleness, int) and staleness > 0) or _get(cfg, "data.replay.enable") is True
    if stale and _get(cfg, "actor.tis_cap") is None:
        cfg.actor.tis_cap = ASYNC_TIS_CAP  # stale (or replayed) samples: truncated importance sampling on by default
    alias = _get(cfg, "adv.lambda")
    if alias is None:
        return
    if _get(cfg, "adv.lamda") not in (None, 1.0, alias):
        _fail("adv.lambda", f"conflicts with adv.lamda={cfg.adv.lamda}; set only one", "adv.lamda=0.95")
    cfg.adv.lamda = alias


def model_names(cfg: DictConfig) -> dict[str, tuple[str, str]]:
    """{config key: (name, kind)} for every model and tokenizer this run loads."""
    used = {"actor.model_name", "actor.tokenizer_name", "rollout.model_name", "rollout.tokenizer_name"}
    if cfg.actor.kl.coef > 0:
        used.add("ref_actor.model_name")
    if _get(cfg, "distill.teacher") is not None:
        used.add("distill.teacher")
    if cfg.adv.estimator == "gae":
        used.add("critic.model_name")
    names = {key: (str(_get(cfg, key)), kind) for key, kind in MODEL_KEYS.items()
             if key in used and _get(cfg, key) is not None}
    for source, teacher in (plain(_get(cfg, "distill.teachers")) or {}).items():  # one key per source's teacher
        names[f"distill.teachers.{source}"] = (str(teacher), "model")
    return names


def useless_settings(cfg: DictConfig) -> list[str]:
    """Settings that pass every check but cannot learn: one warning line each (the run still starts)."""
    out = []
    temperature = _get(cfg, "rollout.train_sampling_params.temperature")
    if temperature is not None and float(temperature) == 0.0:
        out.append("rollout.train_sampling_params.temperature=0 samples greedily: the responses to a prompt are "
                   "all the same, their advantages 0, and nothing is learned; train with a temperature near 1.0")
    group_baseline = cfg.adv.estimator in ("reinforce", "rloo", "reinforce_pp_baseline") and not cfg.adv.global_norm
    teacher = (_get(cfg, "distill.teacher") is not None or bool(_get(cfg, "distill.teachers"))) and \
        (_get(cfg, "distill.coef") or 0) > 0
    if cfg.data.responses_per_prompt == 1 and group_baseline and not teacher:  # (a teacher's advantage is per token)
        out.append(f"data.responses_per_prompt=1 with adv.estimator={cfg.adv.estimator}: a group of one is its "
                   "own baseline, so every advantage is 0 and nothing is learned; sample several responses per "
                   "prompt, or set adv.global_norm=true (one baseline for the whole batch)")
    return out


Resolver = Callable[[Mapping[str, tuple[str, str]]], dict[str, str]]


def collective_timeout_s(cfg: DictConfig) -> float:
    """`trainer.collective_timeout_s`, checked: needed before the process group (and `validate`)."""
    return float(build_field(TrainerConfig, cfg.trainer, "collective_timeout_s", "trainer"))


def rollout_ranks(cfg: DictConfig, world_size: int) -> int:
    """`rollout.ranks` checked against the torchrun world (needed before the process groups exist):
    K rollout ranks leave world - K trainer ranks, each rollout rank serving at least one of them."""
    k = build_field(RolloutConfig, cfg.rollout, "ranks", "rollout")
    if k == 0:
        return 0
    if k > world_size // 2:
        _fail("rollout.ranks", f"{k} rollout ranks need at least as many trainer ranks, and torchrun started "
              f"{world_size} rank(s) in all", f"torchrun --nproc_per_node={2 * k} ... rollout.ranks={k}")
    if _get(cfg, "rollout.engine") != "hf":
        _fail("rollout.ranks", "dedicated rollout ranks run the hf engine only for now", "rollout.engine=hf")
    if (_get(cfg, "actor.lora.rank") or 0) > 0:
        _fail("rollout.ranks", "dedicated rollout ranks do not take LoRA adapters yet", "rollout.ranks=0")
    build_field(RolloutConfig, cfg.rollout, "async_timeout_s", "rollout")
    return k


def resolve_device_defaults(cfg: DictConfig, device_type: str | None = None) -> None:
    """The null settings whose value is the device's, set in `cfg`: actor.dtype and critic.dtype (bfloat16 on a
    GPU, float32 on a CPU; train/models/config.py compute_dtype). `device_type`: the run's (None: the one
    init_distributed will pick on this machine)."""
    if device_type is None:
        from train.parallel.distributed import run_device_type

        device_type = run_device_type()
    for section in ("actor", "critic"):
        if section in cfg and _get(cfg, f"{section}.dtype") is None:
            cfg[section].dtype = compute_dtype(None, device_type)


def validate(cfg: DictConfig, world_size: int = 1, resolve: Resolver | None = None,
             device_type: str | None = None) -> ModelPaths:
    """Raise ConfigError for the first missing or inconsistent key; return the local folders of
    every model. `resolve` turns model names into folders (default: `hub.resolve_all` in this
    process; the trainer passes one that fetches once per node). Null device defaults are set first
    (`resolve_device_defaults`, for `device_type`).

    Each key's type, bounds and choices, unknown keys, and the relations within one section are
    checked by the sections' classes (`load`, train/trainer/schema.py); what is checked here relates
    sections to each other, to the world size, to the files and models on disk."""
    resolve_device_defaults(cfg, device_type)
    for key, example in REQUIRED.items():
        if _get(cfg, key) is None:
            extra = " and so is rollout.model_name" if key == "actor.model_name" else ""
            _fail(key, f"is required (it is null in config/grpo.yaml{extra})", example)
    run = load(cfg)
    for section in SAMPLING_SECTIONS:
        sampling_params(run.rollout, section.split(".")[1])
    rollout, data, trainer = run.rollout, run.data, run.trainer
    if rollout.max_staleness and rollout.dynamic_sampling and not rollout.inflight:
        _fail("rollout.max_staleness", f"{rollout.max_staleness} cannot be combined with rollout.dynamic_sampling=true "
              "(its refill rounds need all ranks between the rollout and the update; rollout.inflight=true refills "
              "from the groups in flight)", "rollout.max_staleness=0")
    if rollout.inflight:
        _validate_inflight(run)
    if data.replay.enable and rollout.inflight:
        _fail("data.replay.enable", "cannot be combined with rollout.inflight=true yet (its steps take groups as they "
              "finish; replay mixes groups into the batches of the synchronous and prefetched sources)",
              "data.replay.enable=false")
    if data.replay.enable and data.replay.criterion is not None and data.replay.priority != "success":
        _fail("data.replay.criterion", f"only applies to data.replay.priority=success (it is {data.replay.priority})",
              "data.replay.criterion=null")
    if data.curriculum.policy != "uniform" and rollout.max_staleness and not rollout.inflight:
        _fail("data.curriculum.policy", f"{data.curriculum.policy} needs rollout.max_staleness=0 (the next batch is "
              "drawn before this step's pass rates are known) or rollout.inflight=true (prompts are admitted after "
              "each step's pass rates are recorded)", "data.curriculum.policy=uniform")
    if trainer.forgetting.max_kl is not None and not trainer.test_samples:
        _fail("trainer.forgetting.max_kl", "judges kl_to_start/test, measured on the sampled evaluation replies: set "
              "trainer.test_samples (and trainer.test_freq)", "trainer.test_samples=4")
    if (trainer.forgetting.watch or trainer.forgetting.max_kl is not None) and trainer.forgetting.action == "raise_kl" \
            and run.actor.kl.coef <= 0:
        _fail("trainer.forgetting.action", "raise_kl multiplies actor.kl.coef, which is 0 (no KL penalty to raise); "
              "start it above 0, which also loads the reference", "actor.kl.coef=0.01")
    _validate_algorithms(run)
    _validate_gpu_keys(run, world_size)

    ppr = data.prompts_per_rollout
    if ppr % world_size != 0:
        _fail("data.prompts_per_rollout", f"{ppr} is not divisible by the {world_size} data-parallel ranks",
              f"data.prompts_per_rollout={max(world_size, ppr - ppr % world_size)}")
    if trainer.health.enable and trainer.health.escalate == "governor" and not trainer.governor.enable:
        _fail("trainer.health.escalate", "governor needs trainer.governor.enable=true (the governor holds and rolls "
              "back what an alarm flags)", "trainer.governor.enable=true")
    if trainer.forgetting.watch and trainer.test_freq is None:
        _fail("trainer.forgetting.watch", "guards evaluation metrics: it needs trainer.test_freq (and "
              "data.test_data_path)", "trainer.test_freq=10")
    if trainer.test_freq is not None and data.test_data_path is None:
        _fail("data.test_data_path", "is required when trainer.test_freq is set",
              "data.test_data_path=stub/data/math/test.jsonl (or trainer.test_freq=null)")

    _validate_sources(run)
    _validate_lora(run)
    load_from = trainer.load_ckpt_from
    if load_from is not None and load_from != "latest":
        from train.runtime.checkpoint import CheckpointError, read_meta

        try:
            read_meta(load_from)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None

    try:  # last: it may download
        paths = ModelPaths.from_resolved((resolve or hub.resolve_all)(model_names(cfg)))
    except hub.ModelNotFound as e:
        raise ConfigError(str(e)) from None
    _validate_parallel(run, world_size, paths)
    if run.actor.lora.rank > 0 and os.path.realpath(paths.rollout) != os.path.realpath(paths.actor):
        _fail("rollout.model_name", f"with actor.lora.rank > 0 the engine must hold the actor's base model "
              f"({paths.actor}): a push sends only the adapters, not {paths.rollout}'s weights",
              "rollout.model_name=null")
    if rollout.share_actor_base:
        from train.models.shared_base import share_base_refusal

        why = share_base_refusal(run, world_size, device_type=None, paths=paths)
        if why is not None:
            _fail("rollout.share_actor_base", f"cannot apply: {why}", "rollout.share_actor_base=null")
    if trainer.forgetting.max_kl is not None:
        from train.trainer.drift import holds_start

        if not holds_start(run.actor.lora.rank > 0, run.actor.kl.coef, run.distill.enabled, paths.actor,
                           paths.reference):
            _fail("trainer.forgetting.max_kl", "needs the starting policy to measure the drift from: a LoRA actor "
                  "(its base), or the KL reference (actor.kl.coef > 0) loaded from actor.model_name (not another "
                  "ref_actor.model_name, not a distillation teacher)", "actor.kl.coef=0.001")
    _validate_rollout_model(paths)
    _validate_experts(run, paths)
    _validate_vision(run, paths)
    if run.distill.enabled:
        _validate_teachers(paths, run.distill.teacher is not None)
    return paths


def data_sources(data) -> tuple[list[Source], list[Source]]:
    """The train and test sources of the data section (train/datasets/mixture.py); test is [] without
    a test set."""
    try:
        train = parse_sources(plain(data.train_data_path), "data.train_data_path")
        test_value = plain(data.test_data_path)
        test = [] if test_value is None else parse_sources(test_value, "data.test_data_path", weights=False)
    except MixtureError as e:
        raise ConfigError(str(e)) from None
    return train, test


def _validate_sources(run: RunConfig) -> None:
    """Data sources well formed; every environment file exists; with environments per source, every
    named source has one."""
    train, test = data_sources(run.data)
    envs = env_paths(run.rollout)
    where = f"relative paths are from {os.getcwd()}"
    if isinstance(envs, str):
        if not os.path.exists(envs):
            _fail("rollout.env_path", f"path '{envs}' does not exist ({where})", REQUIRED["rollout.env_path"])
        return
    if not isinstance(envs, Mapping) or not envs:
        _fail("rollout.env_path", f"expected a path or a mapping source -> path, got {envs!r}",
              "rollout.env_path='{math: environments/eq.py, code: environments/code.py}'")
    for source, path in envs.items():
        if not isinstance(path, str) or not os.path.exists(path):
            _fail(f"rollout.env_path.{source}", f"path {path!r} does not exist ({where})",
                  f"rollout.env_path.{source}=environments/eq.py")
    for key, sources in (("data.train_data_path", train), ("data.test_data_path", test)):
        for source in sources:
            if source.name is not None and source.name not in envs:
                _fail("rollout.env_path", f"source '{source.name}' of {key} has no environment (sources with one: "
                      f"{', '.join(map(str, envs))})", f"rollout.env_path.{source.name}=environments/eq.py")


def sampling_params(rollout, name: str) -> SamplingParams:
    """The rollout section's `train_sampling_params` / `test_sampling_params` (`name`) as
    SamplingParams, every key checked against what the configured engine takes."""
    section, values = f"rollout.{name}", plain(getattr(rollout, name))
    if not isinstance(values, Mapping):
        _fail(section, f"expected a mapping of sampling parameters, got {values!r}",
              f"{section}.max_new_tokens=128")
    try:
        return sampling_from_mapping(dict(values), engine_sampling_keys(rollout.engine))
    except SamplingError as e:
        _fail(f"{section}.{e.key}", f"{e.problem} (rollout.engine={rollout.engine})")


ARCH_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def _validate_rollout_model(paths: ModelPaths) -> None:
    """The engine receives the actor's weights by name and shape, and trains on the token ids it
    samples: a separate rollout model must share the actor's architecture and sizes, a separate
    rollout tokenizer the actor's vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    if os.path.realpath(paths.rollout) != os.path.realpath(paths.actor):
        a, r = AutoConfig.from_pretrained(paths.actor), AutoConfig.from_pretrained(paths.rollout)
        diff = [f"{k}: {getattr(r, k, None)} vs the actor's {getattr(a, k, None)}" for k in ARCH_FIELDS
                if getattr(a, k, None) != getattr(r, k, None)]
        if diff:
            _fail("rollout.model_name", f"'{paths.rollout}' does not match the actor '{paths.actor}' ("
                  + "; ".join(diff) + "): the engine receives the actor's weights after every update, so both "
                  "must share architecture and vocabulary", "rollout.model_name=null (the actor's)")
    if os.path.realpath(paths.rollout_tokenizer) != os.path.realpath(paths.tokenizer):
        a, r = AutoTokenizer.from_pretrained(paths.tokenizer), AutoTokenizer.from_pretrained(paths.rollout_tokenizer)
        if a.get_vocab() != r.get_vocab() or a.eos_token_id != r.eos_token_id:
            _fail("rollout.tokenizer_name", f"'{paths.rollout_tokenizer}' and the actor's tokenizer "
                  f"'{paths.tokenizer}' have different vocabularies (or EOS tokens): the trainer trains on the "
                  "token ids the engine samples, so both must map ids to the same tokens",
                  "rollout.tokenizer_name=null (the actor's)")


def _validate_teachers(paths: ModelPaths, fallback: bool) -> None:
    """A teacher scores the token ids the student sampled: each must map ids to the same tokens as the actor."""
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(paths.tokenizer).get_vocab()
    teachers = {"distill.teacher": paths.reference} if fallback else {}
    teachers.update({f"distill.teachers.{source}": folder for source, folder in paths.teachers.items()})
    for key, folder in teachers.items():
        teacher = AutoTokenizer.from_pretrained(folder).get_vocab()
        if student != teacher:
            differ = sorted(set(student.items()) ^ set(teacher.items()), key=lambda kv: kv[1])[:1]
            first = f"; e.g. token {differ[0][0]!r} (id {differ[0][1]})" if differ else ""
            _fail(key, f"'{folder}' has a different tokenizer from the actor's '{paths.tokenizer}' ({len(teacher)} vs "
                  f"{len(student)} tokens{first}): the teacher scores the student's token ids, so both must share "
                  "one tokenizer (a model of the same family)", f"{key}=runs/teacher/hf")


def _validate_algorithms(run: RunConfig) -> None:
    """Relations between the algorithm keys (issue 7): estimators, critic, KL, DAPO, distillation."""
    adv, kl, rollout = run.adv, run.actor.kl, run.rollout
    if adv.estimator in ("reinforce", "rloo") and adv.gamma != 1.0:
        _fail("adv.gamma", f"{adv.estimator} has one advantage per sequence; discounting needs "
              "adv.estimator=reinforce_pp or gae", "adv.estimator=gae")
    if adv.global_norm and adv.batch_whiten:
        _fail("adv.batch_whiten", "adv.global_norm already normalises with batch statistics; set only one",
              "adv.batch_whiten=false")
    if adv.global_norm and adv.estimator not in ("reinforce", "rloo"):
        _fail("adv.global_norm", f"shares the baseline across prompts for reinforce and rloo, not "
              f"{adv.estimator}", "adv.global_norm=false")
    if adv.batch_whiten and adv.estimator not in ("reinforce", "rloo"):
        _fail("adv.batch_whiten", f"whitens reinforce/rloo advantages; {adv.estimator} has adv.whiten "
              "or normalises by itself", "adv.batch_whiten=false")
    if kl.reward_estimator is not None and adv.estimator in ("reinforce", "rloo") and kl.coef == 0:
        _fail("actor.kl.coef", "actor.kl.reward_estimator is set but the KL coefficient is 0",
              "actor.kl.coef=0.01")

    actor = run.actor
    if actor.loss == "dro" and actor.dro_beta is None:
        _fail("actor.dro_beta", "is required with actor.loss=dro: the weight of its quadratic log-ratio penalty",
              "actor.dro_beta=0.1")
    if actor.loss == "clip_cov" and actor.cov_low >= actor.cov_high:
        _fail("actor.cov_low", f"must be below actor.cov_high ({actor.cov_high}): clip_cov draws the tokens it holds "
              "back from covariance in (cov_low, cov_high)", "actor.cov_low=1.0")

    distill = run.distill
    if not distill.enabled and distill.reward_coef == 0:
        _fail("distill.teacher", "is required with distill.reward_coef=0 (algorithm=distill: the teacher's signal is "
              "the whole advantage); a folder or Hub id sharing the actor's tokenizer", "distill.teacher=runs/teacher/hf")
    if distill.teachers:
        _validate_teacher_routes(run)
    if distill.enabled:
        if kl.coef > 0:
            _fail("actor.kl.coef", "the distillation teacher takes the reference's slot (one frozen model scores "
                  "the samples); its reverse KL already pulls the student towards the teacher", "actor.kl.coef=0")
        if distill.coef == 0 and distill.reward_coef == 0:
            _fail("distill.coef", "and distill.reward_coef are both 0: every advantage would be 0", "distill.coef=1.0")
        if distill.reward_coef == 0 and (rollout.dynamic_filtering or rollout.dynamic_sampling):
            key = "rollout.dynamic_sampling" if rollout.dynamic_sampling else "rollout.dynamic_filtering"
            _fail(key, "drops groups whose rewards tie, but with distill.reward_coef=0 the teacher's per-token signal "
                  "is the whole advantage and every group carries it", f"{key}=false")

    if rollout.dynamic_sampling and run.data.responses_per_prompt < 2:
        _fail("rollout.dynamic_sampling", "needs groups (data.responses_per_prompt >= 2): a group of "
              "one is never informative", "data.responses_per_prompt=8")
    limit = rollout.train_sampling_params["max_new_tokens"] * rollout.max_turns
    buf = rollout.overlong_buffer
    if buf is not None:
        if isinstance(buf, bool) or not isinstance(buf, (int, float)) or buf <= 0 or \
                (isinstance(buf, float) and buf >= 1.0) or (isinstance(buf, int) and buf > limit):
            _fail("rollout.overlong_buffer", f"expected a token count in [1, {limit}] (max_new_tokens x "
                  f"max_turns) or a fraction in (0, 1) of it, got {buf!r}", "rollout.overlong_buffer=0.2")


def _validate_teacher_routes(run: RunConfig) -> None:
    """distill.teachers names training sources; with the teachers' signal as the whole advantage, each has one."""
    distill = run.distill
    names = [source.name for source in data_sources(run.data)[0]]
    if names == [None]:
        _fail("distill.teachers", "routes by data source, but data.train_data_path is one unnamed source; give "
              "one teacher for all with distill.teacher", "distill.teacher=runs/teacher/hf")
    for source in distill.teachers:
        if source not in names:
            _fail(f"distill.teachers.{source}", f"names no source of data.train_data_path (its sources: "
                  f"{', '.join(map(str, names))})", f"distill.teachers.{names[0]}=runs/teacher/hf")
    untaught = [name for name in names if name not in distill.teachers]
    if untaught and distill.teacher is None and distill.reward_coef == 0:
        _fail(f"distill.teachers.{untaught[0]}", "is missing: with distill.reward_coef=0 a source without a teacher "
              "has no advantage at all; name its teacher, set distill.teacher for the rest, or give the task reward "
              "a weight", f"distill.teachers.{untaught[0]}=runs/teacher/hf")


def has_reference_slot(run: RunConfig) -> bool:
    """Whether a frozen model scores the samples beside the actor: the KL reference (actor.kl.coef > 0)
    or the distillation teacher (distill.teacher); both are the reference slot, laid out by ref_actor.*."""
    return run.actor.kl.coef > 0 or run.distill.enabled


PARALLEL_KEYS = ("ddp_size", "tp_size", "sp_size", "ep_size", "cp_size", "offload_model", "offload_optimizer")


def role_config(run: RunConfig, role: str) -> ActorConfig | CriticConfig:
    """The config section a model is built from: `actor`, `critic`, or `ref_actor` (the actor's
    section with ref_actor's non-null parallel keys on top: the reference mirrors the actor unless told)."""
    if role != "ref_actor":
        return getattr(run, role)
    told = {key: getattr(run.ref_actor, key, None) for key in PARALLEL_KEYS}  # (no offload_optimizer: no optimizer)
    return dataclasses.replace(run.actor, **{key: value for key, value in told.items() if value is not None})


def _validate_parallel(run: RunConfig, world_size: int, paths: ModelPaths) -> None:
    """Each model's ddp/tp/sp sizes must lay out on the world and split its heads and vocabulary
    (docs/parallelism.md); reads the model's config.json, not its weights."""
    from transformers import AutoConfig

    from train.models.master_weights import master_weights_refusal
    from train.models.vlm import is_vision_config
    from train.parallel.layout import LayoutError, check_model_fits, layout_sizes
    from train.parallel.parallelize import compile_refusal

    roles = ["actor"]
    if has_reference_slot(run):
        roles.append("ref_actor")
    if run.adv.estimator == "gae":
        roles.append("critic")
    for role in roles:
        section = role_config(run, role)
        try:
            sizes = layout_sizes(world_size, section.ddp_size, section.tp_size, section.sp_size, prefix=role,
                                 ep=getattr(section, "ep_size", None) or 1, cp=getattr(section, "cp_size", None) or 1)
        except LayoutError as e:
            raise ConfigError(f"config: {e}") from None
        if section.compile:
            why = compile_refusal(sizes.tp)
            if why is not None:
                key = "critic.compile" if role == "critic" else "actor.compile"  # (the reference takes the actor's)
                _fail(key, why, f"{key}=false")
        path = {"actor": paths.actor, "ref_actor": paths.reference, "critic": paths.critic}[role]
        # the reference slot holds every distill.teachers model too, each laid out as ref_actor
        for path in [path, *(paths.teachers.values() if role == "ref_actor" else [])]:
            config = AutoConfig.from_pretrained(path)
            quantized = getattr(config, "quantization_config", None)
            if quantized:  # e.g. GPT-OSS's MXFP4 experts: the loader reads plain tensors
                method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
                _fail(f"{role}.model_name", f"{path} is a quantized checkpoint ({method}); training reads bf16/fp32 "
                      "weights: save a dequantized copy first (transformers: from_pretrained(path, quantization_config="
                      "Mxfp4Config(dequantize=True)).save_pretrained(new_path), or that method's own dequantize)",
                      f"{role}.model_name=<the dequantized folder>")
            try:
                check_model_fits(sizes, config, prefix=role)
            except LayoutError as e:
                raise ConfigError(f"config: {e} (model {path})") from None
            if role != "ref_actor" and section.master_weights:  # true: it must apply (null takes it where it does)
                why = master_weights_refusal(role, sizes.ddp * sizes.fsdp * sizes.tp, section.dtype,
                                             bool(section.offload_model), is_vision_config(config))
                if why is not None:
                    _fail(f"{role}.master_weights", f"true cannot apply: {why}", f"{role}.master_weights=null")


def _validate_experts(run: RunConfig, paths: ModelPaths) -> None:
    """actor.router_replay and actor.router_aux_loss_coef need a mixture of experts (from its config.json),
    replay an engine that records routing (hf)."""
    actor, engine = run.actor, run.rollout.engine
    if not actor.router_replay and not actor.router_aux_loss_coef:
        return
    if actor.router_aux_loss_coef and actor.cp_size > 1:
        _fail("actor.router_aux_loss_coef", f"the load-balancing loss is not computed under ring attention "
              f"(actor.cp_size={actor.cp_size}): its per-row counts assume contiguous chunks", "actor.router_aux_loss_coef=0")
    from transformers import AutoConfig

    from train.parallel.tensor_parallel import expert_count

    config = AutoConfig.from_pretrained(paths.actor)
    experts = expert_count(config)
    for key, value, off in (("router_replay", actor.router_replay, "null"), ("router_aux_loss_coef",
                                                                            actor.router_aux_loss_coef, "0")):
        if value and not experts:
            _fail(f"actor.{key}", f"{paths.actor} is not a mixture of experts ({type(config).__name__} has no "
                  "experts): there are no routers", f"actor.{key}={off}")
    if actor.router_replay and engine != "hf":
        _fail("actor.router_replay", f"needs rollout.engine=hf, which records each token's experts; {engine} does "
              "not", "actor.router_replay=null")


def _validate_vision(run: RunConfig, paths: ModelPaths) -> None:
    """A vision-language actor (its config.json has a vision_config; docs/vision.md): a family whose image
    tokens and positions the trainer lays out, its image processor saved with it, and the parts that take
    images (engines of rollout.tp_size=1, trainer-side rollouts, no fused head or teachers yet). A text model refuses
    actor.freeze_vision."""
    from transformers import AutoConfig

    from train.models.vlm import is_vision_config, vision_refusal

    config = AutoConfig.from_pretrained(paths.actor)
    if not is_vision_config(config):
        if run.actor.freeze_vision:
            _fail("actor.freeze_vision", f"{paths.actor} has no vision tower ({type(config).__name__})",
                  "actor.freeze_vision=false")
        return
    why = vision_refusal(config)
    if why is not None:
        _fail("actor.model_name", why, "actor.model_name=<a Qwen2-VL or Qwen2.5-VL folder>")
    if not os.path.isfile(os.path.join(paths.actor, "preprocessor_config.json")):
        _fail("actor.model_name", f"{paths.actor} is a vision-language model without a preprocessor_config.json "
              "(the image processor's settings): save it there", "actor.model_name=<a folder with it>")
    refused = [("rollout.tp_size", run.rollout.tp_size > 1, "images are not forwarded between the ranks of a "
                "tensor-parallel SGLang engine yet", "rollout.tp_size=1"),
               ("rollout.ranks", run.rollout.ranks > 0, "dedicated rollout ranks do not carry images yet",
                "rollout.ranks=0"),
               ("actor.use_liger_kernel", run.actor.use_liger_kernel, "the fused log-prob head is not wired to the "
                "vision tower yet", "actor.use_liger_kernel=false"),
               ("distill.teacher", run.distill.enabled, "teachers do not see the images yet", "distill.teacher=null")]
    for key, bad, why, fix in refused:
        if bad:
            _fail(key, f"{why} ({paths.actor} is a vision-language model)", fix)


def _validate_lora(run: RunConfig) -> None:
    """LoRA under tensor parallelism is refused here rather than run with a wrong plan (the adapters'
    own keys are checked by LoraConfig)."""
    for role in ("actor", "critic"):
        if role == "critic" and run.adv.estimator != "gae":
            continue
        section = getattr(run, role)
        if section.lora.rank > 0 and section.tp_size > 1:
            _fail(f"{role}.lora.rank", f"LoRA with tensor parallelism ({role}.tp_size={section.tp_size}) is not "
                  f"supported: the adapters would need their own TP plan; use FSDP (and {role}.sp_size for long "
                  "sequences) instead", f"{role}.tp_size=1")


def _validate_gpu_keys(run: RunConfig, world_size: int) -> None:
    """The GPU keys' relations to the engine and the world (docs/gpu.md); their types and bounds are
    RolloutConfig's and ActorConfig's."""
    rollout = run.rollout
    if rollout.tp_size > 1 and rollout.engine != "sglang":
        _fail("rollout.tp_size", f"tensor-parallel rollout ({rollout.tp_size}) needs the sglang engine",
              "rollout.engine=sglang")
    if world_size % rollout.tp_size:
        _fail("rollout.tp_size", f"{rollout.tp_size} does not divide the {world_size} ranks", "rollout.tp_size=1")
    if rollout.base_port > 65535 - world_size:
        _fail("rollout.base_port", f"expected a port in [1024, {65535 - world_size}] (one per rank), got "
              f"{rollout.base_port!r}", "rollout.base_port=30000")
    if run.actor.use_liger_kernel and run.actor.tp_size > 1:
        _fail("actor.use_liger_kernel", "the fused log-prob head needs an unsharded lm_head (actor.tp_size=1)",
              "actor.use_liger_kernel=false")


# --- the pre-flight check: `python -m train.trainer.config --check ...` ----------------------------

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"  # where the trainer's @hydra.main looks


def quote_values_with_equals(argv: list[str]) -> list[str]:
    """Hydra's override grammar rejects an unquoted '=' inside a value, as in
    `data.train_data_path=verifiers:train?limit=32`; quote such values so commands work as written."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and "=" in value and value[:1] not in "'\"[{" and "'" not in value:
            arg = f"{key}='{value}'"
        out.append(arg)
    return out


def compose(config_name: str = "grpo", overrides: Sequence[str] = ()) -> DictConfig:
    """The config the trainer receives for `--config-name NAME OVERRIDES...`. `hydra.*` overrides
    steer Hydra's own run (output folders, logging), not the trainer, and are left out."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    kept = [o for o in quote_values_with_equals(list(overrides)) if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=kept)


def check(config_name: str, overrides: Sequence[str], world_size: int) -> tuple[list[str], str]:
    """Compose and validate as the trainer does for `world_size` processes, then check the data
    (bounded: `check_data_preview`); returns the warnings the run would print and what the data
    check read. Raises ConfigError or DataError, or Hydra's error for a key that does not exist or an
    override it cannot parse."""
    cfg = compose(config_name, overrides)
    resolve_aliases(cfg)
    paths = validate(cfg, world_size - rollout_ranks(cfg, world_size))  # the trainer ranks (rollout.ranks)
    run = load(cfg)
    check_run_folder(run.trainer)
    warnings, read = check_data_preview(run, paths)
    return useless_settings(cfg) + warnings, read


def check_run_folder(trainer: TrainerConfig) -> None:
    """A trainer.save_dir that already holds a run is refused here as rank 0 would refuse it at start
    (train/runtime/run_folder.py, the same rule and line), not inside torchrun seconds later. The lock
    (a live run) is not checked: on several nodes it is the run's own rank 0 that holds it."""
    from train.runtime.run_folder import RunFolderError, replaces_a_run

    try:
        replaces_a_run(trainer.save_dir, trainer.load_ckpt_from, trainer.overwrite)
    except RunFolderError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # a folder this user cannot list
        raise ConfigError(f"trainer.save_dir '{trainer.save_dir}' cannot be read: {e.strerror or e}: point "
                          "trainer.save_dir at a folder of yours (e.g. trainer.save_dir=runs/my_run)") from None


def check_data_preview(run: RunConfig, paths: ModelPaths) -> tuple[list[str], str]:
    """The trainer's data checks (train/trainer/data_check.py: sources routed, contamination, prompts
    that fill the context; UTF-8 and the row contract as the loader reads) on the first
    `data.check_rows` rows of each source, read with the trainer's loader: (warnings, what was read).
    Test data is read only when the run evaluates (trainer.test_freq), as the trainer does."""
    from transformers import AutoTokenizer

    limit = run.data.check_rows
    train, test = data_sources(run.data)
    read, rows = [], {"train": [], "test": []}
    for split, sources in (("train", train), ("test", test if run.trainer.test_freq else [])):
        for source in sources:
            part = load_sources([source], None if limit is None else limit + 1)  # one more: is there a rest?
            rest = limit is not None and len(part) > limit
            rows[split] += part[:limit] if rest else part
            read.append(f"the first {limit} rows of {source.path}" if rest else f"all {len(part)} rows of {source.path}")
    tokenizer = AutoTokenizer.from_pretrained(paths.rollout_tokenizer)
    if run.actor.chat_template:
        tokenizer.chat_template = run.actor.chat_template
    envs = env_paths(run.rollout)
    found = check_data(run.data, rows["train"], rows["test"], envs if isinstance(envs, Mapping) else {}, tokenizer,
                       context_length(run.rollout.max_total_length, paths.actor))
    note = "data read: " + ", ".join(read)
    if any(r.startswith("the first") for r in read):
        note += "; later rows are checked when the run loads them, data.check_rows=null reads them all here"
    return found.warnings, note


def one_line(error: BaseException) -> str:
    """Hydra's messages span lines (what failed, the fix; the key's problem in the cause): one line,
    up to a list such as 'Config search path:'."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = str(error.__cause__).strip().splitlines()[:1] if error.__cause__ is not None else []
    kept: list[str] = []
    for line in lines[:1] + cause + lines[1:]:
        if line.endswith(":"):
            break
        kept.append(line)
    # Sentences joined: a full stop between them where Hydra put a line break (not after the last).
    joined = [line if line.endswith((".", ")")) else line + "." for line in kept[:-1]] + kept[-1:]
    return " ".join(joined) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.trainer.config",
        description="Check a run's config before launching it: compose config/NAME.yaml with the overrides as "
                    "the trainer does, run every config check and the data checks on the first data.check_rows rows of "
                    "each source. Prints 'ok (what was read)', or one 'error:' line and exits 2.")
    parser.add_argument("--check", action="store_true", required=True, help="check the config (the only action)")
    parser.add_argument("--config-name", default="grpo", help="a config in config/ (default: grpo)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="the run's total number of processes (nodes x processes per node; default 1)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides key=value, as given to the trainer")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        warnings, read = check(args.config_name, args.overrides, args.nproc)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)  # the trainer's own line
        return 2
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"ok ({read})", flush=True)
    return 0


if __name__ == "__main__":
    from train.trainer.config import main as _main  # the module by its name, so its classes are the trainer's

    sys.exit(_main())
