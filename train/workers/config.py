"""The `rollout:` section (config/grpo.yaml) as typed settings: the engine, sampling, turns and
environments, staleness and the rollout ranks, the sglang keys and the DAPO rollout options."""
from __future__ import annotations

import dataclasses
from typing import Any

from train.engines import ENGINE_NAMES
from train.utils.typed_config import setting


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """`rollout.*`. The sampling parameters are checked against the engine by the trainer's config."""
    engine: str = setting("hf (transformers, anywhere) | sglang (GPU, optional extra)", choices=ENGINE_NAMES)
    model_name: str | None = setting("the engine's starting weights, a folder or a Hub id (null: actor.model_name)")
    tokenizer_name: str | None = setting("null: the actor's tokenizer (must have the same vocabulary)")
    env_path: Any = setting("must choose: a Python file with reward_fn (and interact for multi-turn), or "
                            "{source: file}")
    max_turns: int = setting("turns per conversation", ge=1)
    max_staleness: int = setting("0: generate, then train; k: step N+k's rollout runs while step N trains",
                                 ge=0, expect="an integer >= 0 (0: synchronous; k: step N+k's rollout overlaps "
                                 "step N's update, samples k weight versions old)", example="1")
    inflight: bool = setting("true: sequences keep generating across weight updates; a step trains the first "
                             "groups done (needs max_staleness >= 1, the bound on each sample's oldest token)")
    inflight_mode: str = setting("inflight: lockstep (one segment per step, deterministic: exact resume) | continuous "
                                 "(segments back to back, the push between two; faster with slow envs, not "
                                 "deterministic)", choices=("lockstep", "continuous"))
    segment_tokens: int | None = setting("inflight: tokens each unfinished sample samples per segment (null: "
                                         "max_new_tokens x max_turns / max_staleness)", ge=1, example="32")
    inflight_groups: int | None = setting("inflight: groups kept in flight, all ranks together (null: "
                                          "max_staleness x prompts_per_rollout)", ge=1, example="16")
    over_stale: str = setting("inflight: a sample that would be trained older than max_staleness: requeue (start it "
                              "again from its prompt) | finish (train it past the bound)",
                              choices=("requeue", "finish"))
    async_timeout_s: float = setting("how long the trainer and the rollout side wait for each other before "
                                     "failing", gt=0, example="1800")
    ranks: int = setting("K > 0: the last K torchrun ranks only generate and score, the others only train", ge=0,
                         expect="an integer >= 0 (0: every rank trains and generates)", example="1")
    max_total_length: int | None = setting("tokens a conversation may reach (null: the model's "
                                           "max_position_embeddings)", ge=1)
    max_env_chars: int | None = setting("characters of the env's messages kept per turn (null: 16 per token of "
                                        "context left)", ge=1)
    train_sampling_params: dict[str, Any] = setting("sampling parameters of the training rollouts, given to the "
                                                    "engine as they are")
    test_sampling_params: dict[str, Any] = setting("sampling parameters of the evaluation, given to the engine as "
                                                   "they are")
    max_batch_size: int = setting("sequences per engine forward (hf)", ge=1)
    dtype: str | None = setting("engine weights: float32 | bfloat16 | float16 (null: bfloat16 on GPU, float32 on "
                                "CPU)", choices=("bfloat16", "float32", "float16"))
    static_cache: bool | None = setting("hf: decode over a preallocated KV cache with CUDA graphs (null: on GPU)")
    prefill_chunk: int | None = setting("hf: prompts longer than this many tokens are prefilled in chunks of it "
                                        "through the KV cache (attention memory chunk x prompt, not prompt^2; null: "
                                        "one pass)", ge=1)
    compile_decode: bool | None = setting("hf: torch.compile the engine's norm and MLP module instances (fused "
                                          "element-wise kernels in the decode graphs; null: on GPU)")
    compile_decode_scope: str = setting("hf: what compile_decode compiles: modules (the norm and MLP instances, "
                                        "prefill included) | layers (each whole decoder layer, for the static "
                                        "path's decode steps)", choices=("modules", "layers"))
    share_actor_base: bool | None = setting("hf: the engine's weights are the actor's own tensors, no second copy: "
                                            "LoRA's frozen base, or a full fine-tune's bf16 weights with "
                                            "actor.master_weights when generation never overlaps the update (null: "
                                            "where it applies, true: required)")
    tp_size: int = setting("sglang: GPUs per engine; the first rank of each group of tp_size owns it", ge=1)
    gpu_memory_utilization: float | None = setting("sglang mem_fraction_static: weights + KV cache share of each "
                                                   "GPU", gt=0, le=1, example="0.5")
    bucket_size_mb: float | None = setting("weight push: dtype-grouped buckets of at most this size", gt=0,
                                           example="512")
    push_timeout_s: float | None = setting("a weight push running longer ends the rank (null: no limit)", gt=0,
                                           example="600")
    offload_weights: bool = setting("sleep() also releases the engine weights, not only the KV cache")
    sleep: bool | None = setting("the engine frees its device memory while the models update (KV buffers, CUDA "
                                 "graphs, weights it does not borrow): true | false | null = on a GPU where the "
                                 "update's planned memory does not fit beside it (train/trainer/engine_sleep.py)")
    base_port: int = setting("sglang port = base_port + rank", ge=1024, le=65535, expect="a port in [1024, 65535]",
                             example="30000")
    sglang_kwargs: dict[str, Any] = setting("extra sglang ServerArgs fields, e.g. {context_length: 8192}")
    dynamic_filtering: bool = setting("drop groups whose rewards are all equal")
    env_timeout_s: float = setting("timeout per env call (interact / reward_fn)", gt=0, example="30")
    env_error_reward: float = setting("reward of a sample whose env call raised or timed out")
    env_workers: int = setting("threads for sync env functions", ge=1)
    mask_truncated: bool = setting("drop truncated responses (finish_reason=length) from the loss")
    dynamic_sampling: bool = setting("DAPO: refill with new prompts until prompts_per_rollout informative groups")
    dynamic_sampling_max_rounds: int = setting("rollouts per step at most (then train on what was found)", ge=1)
    overlong_buffer: int | float | None = setting("DAPO soft overlong penalty over the last N tokens (or a "
                                                  "fraction of them, e.g. 0.2)",
                                                  expect="a token count or a fraction in (0, 1), or null",
                                                  example="0.2")
    overlong_penalty: float = setting("the penalty at the length limit", ge=0, example="1.0")


def longest_sample(settings: RolloutConfig, max_new_tokens: int) -> int:
    """The most tokens one sample can sample: every turn to max_new_tokens (capped by the context, when known)."""
    longest = max_new_tokens * settings.max_turns
    return min(longest, settings.max_total_length) if settings.max_total_length else longest
