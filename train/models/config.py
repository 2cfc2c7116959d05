"""The model sections of config/grpo.yaml as typed settings: `actor:` (model, optimizer, loss,
entropy, KL, LoRA, layout), `ref_actor:` and `critic:`. Choice lists are the registries of
train/algorithms/, read at each check."""
from __future__ import annotations

import copy
import dataclasses

from train.algorithms.aggregation import AGG_MODES
from train.algorithms.kl import KL_ESTIMATORS
from train.algorithms.mismatch import MIS_LEVELS, TIS_LEVELS
from train.algorithms.policy_loss import POLICY_LOSSES
from train.algorithms.schedules import ENTROPY_SCHEDULES
from train.models.router_replay import REPLAY_MODES
from train.utils.typed_config import SectionError, setting

DTYPES = ("float32", "bfloat16")  # actor.dtype, critic.dtype


def compute_dtype(asked: str | None, device_type: str) -> str:
    """actor.dtype / critic.dtype / rollout.dtype: null is bfloat16 on a GPU (tensor cores, half the activation
    memory; the weights AdamW steps stay fp32 either way) and float32 on a CPU."""
    if asked is not None:
        return asked
    return "bfloat16" if device_type == "cuda" else "float32"


def replaced(cfg, **values):
    """A copy of `cfg` with `values`: the typed section (a frozen dataclass), or an OmegaConf section
    (benchmarks, tests)."""
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, **values)
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        setattr(out, key, value)
    return out


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """`actor.lora.*` / `critic.lora.*`: adapters on a frozen base (train/models/lora.py)."""
    rank: int = setting("0: full fine-tuning; e.g. 16 (use a higher lr than a full fine-tune)", ge=0,
                        expect="0 (off) or a positive integer", example="16")
    alpha: float = setting("the update is (alpha / rank) * B A", gt=0, example="32")
    dropout: float = setting("dropout on the adapters' input while training", ge=0, lt=1, example="0.05")
    target_modules: list[str] = setting("the module names that get adapters")

    def check(self) -> None:
        if self.rank > 0 and (not self.target_modules or not all(self.target_modules)):
            raise SectionError("target_modules", f"expected a non-empty list of module names, got {self.target_modules!r}",
                               "[q_proj,v_proj]")


@dataclasses.dataclass(frozen=True)
class EntropyConfig:
    """`actor.entropy.*`: the entropy bonus and its schedule."""
    coef: float = setting("entropy bonus (subtracted from the loss)", ge=0, example="0.001")
    schedule: str = setting("constant | linear | cosine decay from coef to min_coef", choices=ENTROPY_SCHEDULES)
    min_coef: float = setting("the schedule's floor", ge=0, example="0.0")
    decay_steps: int | None = setting("optimizer steps to reach the floor (null: all of the run's)", ge=1)

    def check(self) -> None:
        if self.schedule != "constant" and self.min_coef > self.coef:
            raise SectionError("min_coef", f"the floor {self.min_coef} is above the start coef {self.coef}",
                               f"{self.coef / 10:g}")


def entropy_in_loss(entropy: EntropyConfig) -> bool:
    """Whether the entropy bonus has a gradient at some step (its coef or the schedule's floor is not 0); an
    `actor.entropy` section as a typed config or as an OmegaConf one."""
    return bool(entropy.coef or entropy.min_coef)


@dataclasses.dataclass(frozen=True)
class KLConfig:
    """`actor.kl.*`: the KL penalty to the reference actor, in the loss or in the reward."""
    coef: float = setting(">0 loads a reference actor", ge=0, example="0.001")
    type: str = setting("the KL estimator in the loss: k1 | k2 | k3 | low_var_kl", choices=KL_ESTIMATORS.names)
    reward_estimator: str | None = setting("set (e.g. k1) to put KL in the reward instead of the loss",
                                           choices=KL_ESTIMATORS.names)


@dataclasses.dataclass(frozen=True)
class ActorConfig:
    """`actor.*`: the policy that trains."""
    model_name: str | None = setting("must choose: a local HF model folder or a Hub id")
    tokenizer_name: str | None = setting("a folder or a Hub id (null: model_name)")
    chat_template: str | None = setting("optional Jinja template that replaces the tokenizer's")
    dtype: str | None = setting("float32 | bfloat16: the update's compute (bf16: fp32 masters, actor.master_weights, or "
                                "FSDP2's mixed precision); null: bfloat16 on GPU, float32 on CPU", choices=DTYPES)
    master_weights: bool | None = setting("bf16 on one process (no FSDP, no TP): true = bf16 weights with fp32 masters "
                                          "cast into them once per optimizer step (train/models/master_weights.py); "
                                          "false = FSDP2's mixed precision; null: on where it applies (on a GPU, when "
                                          "the memory plan says it fits)")
    max_length_per_device: int | None = setting("tokens per packed micro-batch per device in the update (x sp_size "
                                                "per pack); null: the longest that fits this GPU's free memory "
                                                "(train/models/memory_plan.py), 4096 on CPU", ge=1)
    max_inference_length_per_device: int | None = setting("the same for no-grad passes (null: 2x the above)", ge=1)
    lr: float = setting("the learning rate", gt=0, example="1e-6")
    weight_decay: float = setting("AdamW weight decay")
    betas: list[float] = setting("AdamW betas")
    warmup_ratio: float = setting("share of the steps with a linear lr warmup", ge=0, lt=1, example="0.05")
    scheduler: str = setting("constant | cosine", choices=("constant", "cosine"))
    min_lr_ratio: float = setting("cosine floor, as a fraction of lr")
    max_grad_norm: float = setting("gradient clipping norm")
    update_per_rollout: int = setting("passes over each rollout batch (>1 recomputes old log-probs)", ge=1)
    mini_batches: int = setting("optimizer steps per pass", ge=1)
    freeze_steps: int = setting("steps during which the actor is not updated (the critic still is)", ge=0)
    freeze_vision: bool = setting("vision-language models: the vision tower (and its merger) is not trained")
    target_kl: float | None = setting("stop the update_per_rollout epochs once approx_kl exceeds this", gt=0,
                                      example="0.02")
    loss: str = setting("ppo (token ratio) | gspo (sequence ratio) | cispo (clipped, detached IS weight) | gmpo "
                        "(geometric mean of clipped token ratios) | gpg (no ratio) | dppo_tv, dppo_kl (trust region "
                        "on the token's probability) | sapo (soft gate) | dro (quadratic penalty) | clip_cov, kl_cov "
                        "(hold back high-covariance tokens)", choices=POLICY_LOSSES.names)
    clip: float = setting("PPO clip; clip_low/clip_high override it (DAPO clip-higher)", gt=0, example="0.2")
    clip_low: float | None = setting("the ratio floor is 1 - clip_low (null: clip)", gt=0, lt=1, example="0.2",
                                      expect="a number > 0 and < 1 (the ratio floor is 1 - clip_low), or null")
    clip_high: float | None = setting("the ratio ceiling is 1 + clip_high (null: clip)", gt=0, example="0.28")
    gspo_clip_low: float | None = setting("GSPO's sequence-ratio clip range, low side (used when clip_low is null)",
                                          gt=0, example="0.28")
    gspo_clip_high: float | None = setting("GSPO's sequence-ratio clip range, high side (used when clip_high is "
                                           "null)", gt=0, example="0.28")
    cispo_clip_low: float | None = setting("CISPO's IS-weight floor is 1 - cispo_clip_low (null: no floor, the "
                                           "paper; used when clip_low is null)", gt=0, le=1, example="0.2")
    cispo_clip_high: float = setting("CISPO's IS-weight ceiling is 1 + cispo_clip_high (used when clip_high is "
                                     "null)", gt=0, example="5.0")
    dual_clip: float | None = setting("dual-clip bound on negative-advantage ratios (null: off)", gt=1,
                                      example="3.0")
    dppo_ratio_cap: float = setting("dppo_tv/dppo_kl: ceiling of the detached importance weight (truncated IS)",
                                    gt=1, example="20.0")
    sapo_tau_pos: float = setting("sapo: gate temperature for positive-advantage tokens", gt=0, example="1.0")
    sapo_tau_neg: float = setting("sapo: gate temperature for the others (> sapo_tau_pos fades them faster)", gt=0,
                                  example="1.05")
    dro_beta: float | None = setting("dro: weight of the quadratic log-ratio penalty (required with loss=dro)", gt=0,
                                     example="0.1")
    cov_ratio: float = setting("clip_cov/kl_cov: share of a micro-batch's tokens held back", gt=0, lt=1,
                               example="0.0002")
    cov_low: float = setting("clip_cov: the held-back tokens are drawn from covariance in (cov_low, cov_high)",
                             example="1.0")
    cov_high: float = setting("clip_cov: see cov_low", example="5.0")
    kl_cov_coef: float = setting("kl_cov: weight of |log ratio| on the held-back tokens", gt=0, example="1.0")
    agg_mode: str = setting("all_token_mean | seq_mean_token_mean | seq_mean_token_sum_norm | seq_mean_token_sum",
                            choices=AGG_MODES.names)
    loss_norm_length: int | None = setting("constant normaliser for seq_mean_token_sum_norm (null: max_new_tokens)",
                                           ge=1)
    entropy: EntropyConfig = setting("the entropy bonus")
    kl: KLConfig = setting("the KL penalty to the reference actor")
    tis_cap: float | None = setting("truncated importance sampling of the sampler/trainer mismatch (null: 2.0 with "
                                    "rollout.max_staleness >= 1, else off)", gt=0, example="2.0")
    tis_level: str = setting("token | sequence (product of the token ratios)", choices=TIS_LEVELS)
    mis_level: str | None = setting("masked IS: drop tokens (token) or whole samples (sequence: geometric mean) "
                                    "whose trainer/sampler ratio leaves [mis_low, mis_high] (null: off)",
                                    choices=MIS_LEVELS, example="token")
    mis_low: float = setting("masked IS: the lowest trainer/sampler ratio kept", gt=0, lt=1, example="0.5")
    mis_high: float = setting("masked IS: the highest trainer/sampler ratio kept", gt=1, example="2.0")
    gradient_checkpointing: bool | None = setting("recompute activations in the backward pass (null: on a GPU, "
                                                  "when the update would not fit without, for the packs longer than "
                                                  "fit without it; off on CPU)")
    use_liger_kernel: bool | None = setting("fused log-prob/entropy head, no [batch, seq, vocab] logits (null: on a "
                                            "GPU for micro-batches of 8192 tokens or more, where it applies)")
    compile: bool = setting("torch.compile each decoder layer of the actor (and of its KL reference): its "
                            "element-wise work fused; compiles on the first micro-batches (docs/gpu.md)")
    share_prompt: bool = setting("each group's prompt laid out once per packed row in every pass")
    router_replay: str | None = setting("mixtures of experts: null (off) | response (positions holding sampled "
                                        "tokens) | all (the prompt's and tool replies' too): the trainer's routers "
                                        "take the experts the sampler chose", choices=REPLAY_MODES, example="response")
    router_aux_loss_coef: float = setting("mixtures of experts: weight of the routers' load-balancing loss "
                                          "(Switch Transformer's, as transformers computes it)", ge=0, example="0.001")
    lora: LoraConfig = setting("LoRA adapters on a frozen base")
    ddp_size: int = setting("replicas: FSDP2 hybrid sharding replicates over ddp, shards over fsdp", ge=1)
    tp_size: int = setting("tensor parallel size (heads, MLP, vocab-parallel lm_head)", ge=1)
    sp_size: int = setting("Ulysses sequence parallel: each packed row split over sp ranks", ge=1)
    ep_size: int = setting("expert parallel (mixtures of experts): each layer's routed experts split over ep of the "
                           "fsdp ranks, tokens sent to them by all-to-all", ge=1)
    cp_size: int = setting("context parallel: each packed row split zigzag over cp ranks, ring attention (long "
                           "sequences; no head-count limit)", ge=1)
    offload_model: bool = setting("FSDP2 CPU offload of parameters and gradients (optimizer step on CPU)")
    offload_optimizer: bool = setting("Adam moments on the CPU between steps")


@dataclasses.dataclass(frozen=True)
class RefActorConfig:
    """`ref_actor.*`: the KL reference (actor.kl.coef > 0); null keys take the actor's value."""
    model_name: str | None = setting("a folder or a Hub id (null: actor.model_name)")
    ddp_size: int | None = setting("null: the actor's", ge=1)
    tp_size: int | None = setting("null: the actor's", ge=1)
    sp_size: int | None = setting("null: the actor's", ge=1)
    ep_size: int | None = setting("null: the actor's", ge=1)
    cp_size: int | None = setting("null: the actor's", ge=1)
    offload_model: bool | None = setting("null: the actor's")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """`critic.*`: the value model of PPO (adv.estimator=gae), a value head on the actor's architecture."""
    model_name: str | None = setting("its backbone, a folder or a Hub id (null: actor.model_name)")
    ddp_size: int = setting("the critic's own layout (see actor.ddp_size)", ge=1)
    tp_size: int = setting("the critic's tensor parallel size", ge=1)
    sp_size: int = setting("the critic's sequence parallel size", ge=1)
    cp_size: int = setting("the critic's context parallel size (ring attention)", ge=1)
    offload_model: bool = setting("FSDP2 CPU offload of parameters and gradients")
    offload_optimizer: bool = setting("Adam moments on the CPU between steps")
    dtype: str | None = setting("float32 | bfloat16 (as actor.dtype; null: bfloat16 on GPU, float32 on CPU)",
                                choices=DTYPES)
    master_weights: bool | None = setting("as actor.master_weights (null: on where it applies on CPU, off on a GPU)")
    gradient_checkpointing: bool = setting("recompute activations in the backward pass")
    compile: bool = setting("torch.compile each decoder layer (as actor.compile)")
    lora: LoraConfig = setting("adapters on the critic's backbone (as actor.lora); the value head trains fully")
    lr: float = setting("the learning rate", gt=0, example="1e-5")
    weight_decay: float = setting("AdamW weight decay")
    betas: list[float] = setting("AdamW betas")
    warmup_ratio: float = setting("share of the steps with a linear lr warmup", ge=0, le=1, example="0.0")
    max_grad_norm: float = setting("gradient clipping norm", gt=0, example="1.0")
    max_length_per_device: int = setting("tokens per packed micro-batch per device in the update", ge=1)
    max_inference_length_per_device: int | None = setting("the same for no-grad passes (null: 2x the above)", ge=1)
    update_per_rollout: int = setting("passes over each rollout batch", ge=1)
    mini_batches: int = setting("optimizer steps per pass", ge=1)
    clip: float | None = setting("value clip around the pre-update values (null: unclipped)", gt=0, example="0.5")
    reward_norm: bool = setting("scale rewards by 1 / running std of all rewards seen (the critic's targets)")
