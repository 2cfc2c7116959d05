"""What fits on one GPU: device memory of an RL step on one rank, estimated from a model's config.

    .venv/bin/python -m train.models.memory_plan --model llama3.1-8b --lora-rank 32 --seq 16384
    .venv/bin/python -m train.models.memory_plan --model path/to/hf_folder --seq 8192   # full fine-tuning (no --lora-rank)
    .venv/bin/python -m train.models.memory_plan --table          # the presets on 80 GB and 141 GB cards

The rule, per rank with the actor unsharded (one GPU), P parameters, L LoRA adapter parameters,
bf16 compute (`actor.dtype=bfloat16`), S tokens per packed micro-batch:

- actor weights: full fine-tuning keeps fp32 master weights (4P); LoRA keeps the frozen base in bf16
  (2P) and fp32 adapters (4L). Gradients 4 bytes and AdamW moments 8 bytes per trainable parameter. With
  `actor.master_weights` (`master_weights=True`) the trainable weights' bf16 copies (2 bytes) and the
  backward's bf16 gradients (2 bytes) are held whole and nothing is unsharded.
  Fused AdamW (train/models/optim.py) adds no temporary; the `foreach` one added 4 bytes per trainable
  parameter during the step (`--foreach`, to compare with runs before that change).
- update activations with gradient checkpointing: every layer's bf16 input (layers x S x hidden x 2),
  plus one layer's recomputed working set, about 1.5 x (4 hidden + 3 query + 3 key/value + 5
  intermediate) x S x 2 bytes. A mixture of experts counts, in place of 5 intermediate,
  each of a token's top-k copies (2 hidden + 5 x the expert's width), the shared experts and the router
  (`mlp_width`); attention sinks (GPT-OSS) add the packed attention's per-segment scores (`attention_width`).
  Checked against what a bf16 forward saves for its backward, family by family, in
  tests/unit/test_memory_plan.py. The vocabulary head's peak comes while a checkpointed model keeps only its
  layers' inputs (every layer's set without checkpointing), so it adds the larger of its own peak and one
  layer's set (`head_bytes`): the plain head's float32 logits and its backward's temporaries (16 bytes per
  token and vocabulary entry, 21 with an entropy bonus); the fused head's one chunk of 2048 tokens (8 bytes
  per chunk token and entry in float32, forward or backward), and for a trained head its float32 gradient
  (6 bytes per head parameter). Measured on CPU in tests/integration/test_fused_logprobs.py. FSDP2's one-rank
  unshard of the largest group (the embeddings, or one layer) in bf16, and for a full fine-tune its fp32
  gradient before the reduce.
- rollout: the actor's weights and optimizer state stay (gradients are freed after the step), the
  engine's own bf16 weights (2P + 2L; 2L when it borrows the actor's frozen base,
  `rollout.share_actor_base`; none when it borrows a full fine-tune's bf16 weights, with masters) and the KV
  cache of the replies in flight. The engine sleeps (its
  weights to host memory) during the update where the update needs that memory (`rollout.sleep`, below).
- push: the actor's weights and optimizer state, the engine's weights and two buckets of what is sent
  (`rollout.bucket_size_mb` each, at most the bytes sent: 2P in bf16, 2L with LoRA): the bucket being
  filled and the one whose tensors the engine is still copying.

A plan "fits" a card when its larger phase, plus 10% for the allocator and what the rule leaves out,
stays under the card's memory. Checked against the H100 runs of `benchmarks/gpu_suite.py --only bigmodel`
(tests/unit/test_memory_plan.py holds those figures). Without gradient checkpointing every layer keeps its
working set (layers x the one-layer set above). Under FSDP over F ranks the weights, gradients and moments
are F times smaller per rank; activations are not.

`auto_settings` turns three null actor settings into values on a GPU (`train/models/memory_settings.py` calls it
before building the model; on CPU they are 4096, off and off, as before):

- `actor.use_liger_kernel` (the fused log-prob head): on where it applies (tp_size 1, a text model whose
  logits are not post-processed) and the micro-batch is >= 8192 tokens. Measured on an H100 at 8K and 16K
  tokens: the same update time as the plain head within 2%, without the [tokens, vocab] logits.
- `actor.max_length_per_device`: the largest multiple of 1024 up to 65536 whose update peak (this plan,
  with checkpointing unless it is set off) plus 10% fits the device's free memory when the actor is built,
  less what the reference, teachers or critic will keep (`resident_bytes`; the engine sleeps during the
  update; where the configuration keeps it awake, half of what its weights leave: train/models/memory_settings.py);
  1024 at least.
- `actor.gradient_checkpointing`: off when the update at that length fits without it, else on for the
  micro-batches that need it: those longer than the longest multiple of 1024 whose update fits without it
  (`recompute_above`, decided with actor.master_weights), a limit each update lowers to the working bytes that
  the least free rank has room for when it starts (Trainable._recompute_limit: an engine kept awake leaves
  less). A shorter micro-batch keeps its activations and skips the recompute; every rank takes the same choice
  for the same pack (its longest over the ranks decides).

`working_bytes` is what an update needs beyond the weights and AdamW moments that stay allocated between steps:
its gradients, activations and unshard (or the optimizer step's temporary, or the push's two buckets, whichever
is most), at the longer of the update's and the no-grad passes' micro-batch (or the step batch's tokens where
those are fewer: no pack is longer); before the first optimizer step the moments too (fused AdamW allocates
them there). `rollout.sleep=null`
(train/trainer/engine_sleep.py) keeps the engine awake through the update where the free memory covers it.

`master_weights_fit` then decides a null `actor.master_weights` (train/models/memory_settings.py): on where the plan
with it, at the settings chosen, plus 10% fits the same free memory. A frozen model of the run (the KL
reference) holds its weights in the run's dtype: `resident_bytes(..., weight_bytes=2)` in bf16.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from train.models.vlm import text_config
from train.parallel.fused_logprobs import DEFAULT_CHUNK_TOKENS, WEIGHT_GRAD_ROWS

GIB = 2**30
MOMENT_BUCKET_BYTES = GIB  # actor.offload_optimizer: the most optimizer state on the device during the step
HEADROOM = 1.10
CARDS = {"80 GB (H100)": 79.2, "141 GB (H200)": 139.8}  # usable GiB that torch reports on each

# Shapes only (no weights): the configs benchmarks/gpu_suite.py builds its big models from.
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True),
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
                      tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False),
}


def preset_config(name: str):
    """The transformers config of a preset (shapes of the public model of that name)."""
    from transformers import AutoConfig

    kw = dict(PRESETS[name])
    return AutoConfig.for_model(kw.pop("model_type"), bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)


def load_config(model: str):
    """A preset name or a model folder (its config.json)."""
    if model in PRESETS:
        return preset_config(model)
    if os.path.isdir(model):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    raise ValueError(f"--model {model!r}: neither a preset ({', '.join(PRESETS)}) nor a model folder")


def count_parameters(config, lora_rank: int = 0, value_head: bool = False) -> tuple[int, int]:
    """(base parameters, LoRA adapter parameters at `lora_rank` on the default targets), counted on a
    model built on the meta device: exact, tied embeddings once. `value_head`: the critic's model
    (train/models/value_model.py: the backbone without the LM head, and a value head)."""
    import torch
    from transformers import AutoModel

    from train.models.lora import DEFAULT_TARGETS
    from train.models.value_model import ValueModel
    from train.models.vlm import model_class

    with torch.device("meta"):
        model = ValueModel(AutoModel.from_config(config)) if value_head else model_class(config).from_config(config)
    # peft's A (rank x in) and B (out x rank) on every targeted linear layer
    adapters = sum(lora_rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in DEFAULT_TARGETS)
    return sum(p.numel() for p in model.parameters()), adapters


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank by part; `update_peak` and `rollout_peak` are the two phases' totals."""
    params: int
    adapters: int
    weights: int
    gradients: int
    optimizer: int
    optimizer_temporary: int
    activations: int
    unshard: int
    engine_weights: int
    kv_cache: int
    push_buffers: int = 0

    @property
    def update_peak(self) -> int:
        backward = self.weights + self.gradients + self.optimizer + self.activations + self.unshard
        step = self.weights + self.gradients + self.optimizer + self.optimizer_temporary
        return max(backward, step)

    @property
    def rollout_peak(self) -> int:
        return self.weights + self.optimizer + self.engine_weights + self.kv_cache

    @property
    def push_peak(self) -> int:
        return self.weights + self.optimizer + self.engine_weights + self.push_buffers

    @property
    def peak(self) -> int:
        return max(self.update_peak, self.rollout_peak, self.push_peak)

    def fits(self, card_gib: float) -> bool:
        return self.peak * HEADROOM / GIB <= card_gib


def plan(config, *, seq: int, lora_rank: int = 0, share_base: bool = True, replies: int = 8,
         prompt: int = 1024, new: int = 128, fused_head: bool = True, foreach: bool = False,
         counts: tuple[int, int] | None = None, checkpointing: bool = True, shards: int = 1,
         bucket_mb: float = 512, master_weights: bool = False, entropy: bool = False,
         lm_head: bool = True, offload_optimizer: bool = False) -> MemoryPlan:
    """The memory of one step (module docstring) for `config` at `seq` tokens per micro-batch;
    `counts`: `count_parameters(config, lora_rank, value_head=not lm_head)` when the caller has it already;
    `shards`: the FSDP ranks the weights, gradients and moments are split over; `bucket_mb`: `rollout.bucket_size_mb`;
    `master_weights` (one rank, `actor.master_weights`): the trainable weights' bf16 copies and the
    backward's bf16 gradients are held whole (2 + 2 bytes per trainable parameter), and nothing is unsharded;
    with `share_base` the engine then borrows a full fine-tune's bf16 weights too (no engine weights);
    `entropy`: an entropy bonus in the loss (actor.entropy.coef > 0); `lm_head` False: a value head (a critic);
    `offload_optimizer` (actor.offload_optimizer): the moments on the host but for one bucket in the step."""
    params, adapters = counts or count_parameters(config, lora_rank, value_head=not lm_head)
    config = text_config(config)  # a vision-language model: its language model's shapes (the tower's activations are left out)
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    _, head_dim, kv_heads = attention_heads(config)
    trainable = adapters if lora_rank else params
    weights = (2 * params + 4 * adapters) if lora_rank else 4 * params
    checkpoints = layers * seq * h * 2
    layer_set = int(1.5 * (4 * h + attention_width(config, seq) + mlp_width(config)) * seq * 2)
    head = head_bytes(config, seq, fused=fused_head, trained=not lora_rank, entropy=entropy) if lm_head else 0
    kept = checkpoints + max(layer_set, head) if checkpointing else layers * layer_set + head
    largest_group = max(vocab * h, params // max(layers, 1))
    unshard = 0 if master_weights else largest_group * 2 + (0 if lora_rank else largest_group * 4)
    if master_weights:
        weights += 2 * trainable
    gradients = (6 if master_weights else 4) * trainable
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    # the engine borrows a LoRA actor's base, or with masters a full fine-tune's bf16 weights (share_base)
    engine = 2 * adapters if (share_base and (lora_rank or master_weights)) else 2 * (params + adapters)
    shards = max(1, shards)
    moments = 8 * trainable // shards
    if offload_optimizer:  # optim.HostMoments: a bucket of moments on the device in the step, none otherwise
        optimizer, temporary = 0, min(MOMENT_BUCKET_BYTES, moments)
    else:
        optimizer, temporary = moments, (4 * trainable // shards) if foreach else 0
    return MemoryPlan(params=params, adapters=adapters, weights=weights // shards, gradients=gradients // shards,
                      optimizer=optimizer, optimizer_temporary=temporary,
                      activations=kept, unshard=unshard, engine_weights=engine,
                      kv_cache=replies * (prompt + new) * kv_per_token,
                      push_buffers=2 * min(int(bucket_mb * 2**20), 2 * (adapters if lora_rank else params)))


def head_bytes(config, seq: int, *, fused: bool, trained: bool, entropy: bool = False,
               chunk: int = DEFAULT_CHUNK_TOKENS) -> int:
    """The vocabulary head's peak at `seq` tokens in the update's forward or backward, beyond what the layers keep
    for theirs. The plain head (train/algorithms/logits.py head_logprobs_entropy): its float32 logits and the
    backward's temporaries, 16 bytes per token and vocabulary entry (21 with the entropy's graph, `entropy`), and
    the hidden states' gradient (2 bytes per token and hidden unit). The fused one
    (train/parallel/fused_logprobs.py), per token and entry of one chunk: in the forward the logits as they are
    cast to float32 (6 bytes; the entropy metric's exponentials, a block of rows at a time, add half a byte to
    the float32 ones after the cast); in the backward the same cast and then the gradient in their storage
    (6 bytes; 8 with the entropy's term), with the hidden states' gradient
    and for a `trained` head (not LoRA's frozen one) its float32 gradient, added to a slice of vocabulary rows at a
    time (the slice's product in bf16 and float32 beside the chunk's bf16 gradient), which the bf16 one is cast
    from at the end (6 bytes per head parameter at most)."""
    vocab, h = config.vocab_size, config.hidden_size
    grads = 2 * seq * h
    if not fused:
        return grads + (21 if entropy else 16) * seq * vocab
    tokens = min(seq, chunk)
    if not trained:  # (the backward's peak: the forward's, 6 bytes per entry, and the hidden states' gradient)
        return grads + (8 if entropy else 6) * tokens * vocab
    slice_product = 2 * tokens * vocab + 6 * min(vocab, WEIGHT_GRAD_ROWS) * h
    return grads + 4 * vocab * h + max((8 if entropy else 6) * tokens * vocab, slice_product, 2 * vocab * h)


ATTENTION_SINKS = ("gpt_oss",)  # model types whose attention has one sink logit per head (GPT-OSS)


def attention_heads(config) -> tuple[int, int, int]:
    """(query heads, head size, key/value heads) from a model's config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, head_dim, getattr(config, "num_key_value_heads", None) or heads


def attention_width(config, seq: int) -> int:
    """Values per token that one layer's attention keeps for the backward (2 bytes each in bf16): its queries,
    keys and values with their projections' outputs, RoPE's copies and q/k norms (3 x query width + 3 x
    key/value width; SDPA's flash and efficient kernels keep only their output and log-sum-exp besides). With
    attention sinks the packed attention (train/parallel/seq_parallel.py) takes explicit scores per segment, keeping fp32 probabilities and their bf16
    copy (6 bytes per head, query and key of a segment): 3 x heads x seq, the worst case of one segment as long
    as the micro-batch."""
    heads, head_dim, kv_heads = attention_heads(config)
    scores = 3 * heads * seq if getattr(config, "model_type", None) in ATTENTION_SINKS else 0
    return 3 * heads * head_dim + 3 * kv_heads * head_dim + scores


def mlp_width(config) -> int:
    """Values per token that one layer's MLP keeps for the backward (2 bytes each in bf16). A dense MLP:
    5 x intermediate_size (the gate's and up projection's outputs, the activation, their product, and the
    down projection's input). A mixture of experts: for each of the top-k copies of a token, its gathered input
    and weighted output (2 x hidden) and 5 x the expert's width; the shared experts' 5 x their width; the
    router's fp32 logits and probabilities (4 x experts, counted in 2-byte values). A model with both kinds of
    layer (Qwen-MoE's mlp_only_layers, DeepSeek's first dense layers) takes the larger for every layer."""
    from train.parallel.tensor_parallel import expert_count

    dense = 5 * config.intermediate_size
    experts = expert_count(config)
    if not experts:
        return dense
    top_k = config.num_experts_per_tok
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or (getattr(config, "n_shared_experts", None) or 0) * width)
    return max(dense, top_k * (2 * config.hidden_size + 5 * width) + 5 * shared + 4 * experts)


def free_device_bytes(device) -> int:
    """This rank's CUDA `device` bytes a new allocation can take now: free on the device, plus the allocator's
    reserved blocks that hold no tensor."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def resident_bytes(config, *, trainable: bool, shards: int = 1, weight_bytes: int = 4,
                   value_head: bool = False) -> int:
    """Device bytes per rank that another model of the run keeps through the actor's update: a frozen one
    (the KL reference, a teacher) its weights in the run's dtype (`weight_bytes`: 2 in bf16), a trained one
    (the critic) fp32 weights, gradients and AdamW moments (16 bytes per parameter), over `shards` FSDP ranks;
    `value_head`: the critic's model, without the LM head (count_parameters)."""
    params, _ = count_parameters(config, value_head=value_head)
    return params * (16 if trainable else weight_bytes) // max(1, shards)


CPU_MAX_LENGTH = 4096  # actor.max_length_per_device=null on CPU (the default before it could be null)
LONG_MICRO_BATCH = 8192  # the fused head's threshold
MAX_AUTO_LENGTH = 65536
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


@dataclass(frozen=True)
class AutoSettings:
    """The three settings `auto_settings` decides, and one line saying how (None: nothing was null)."""
    max_length_per_device: int
    gradient_checkpointing: bool
    use_liger_kernel: bool
    note: str | None = None


def fused_head_applies(config, tp_size: int) -> bool:
    """The fused head replaces `lm_head(h)`: not with a vocabulary split over tp ranks, a vision-language
    model's head, or logits the model post-processes (train/parallel/fused_logprobs.py checks the built model)."""
    from train.models.vlm import is_vision_config

    return (tp_size == 1 and not is_vision_config(config)
            and all(getattr(config, a, None) in (None, 1, 1.0) for a in LOGIT_POSTPROCESSING))


def longest_fitting(lengths: Iterable[int], fits: Callable[[int], bool]) -> int | None:
    """The last of `lengths` (ascending) that `fits`; None where none does."""
    fitting = [s for s in lengths if fits(s)]
    return fitting[-1] if fitting else None


def update_need(config, seq: int, *, fused_head: bool, checkpointing: bool, lora_rank: int = 0, shards: int = 1,
                offload_optimizer: bool = False, offload_model: bool = False, master_weights: bool = False,
                counts: tuple[int, int] | None = None, entropy: bool = False) -> float:
    """The update's peak at `seq` tokens per micro-batch (`plan`) plus 10%: what must be free for it. With
    actor.offload_optimizer the moments are not on the device but for one bucket of them in the step
    (optim.HostMoments); with offload_model neither they nor the weights and gradients are."""
    p = plan(config, seq=seq, lora_rank=lora_rank, fused_head=fused_head, counts=counts, checkpointing=checkpointing,
             shards=shards, master_weights=master_weights, entropy=entropy, offload_optimizer=offload_optimizer)
    if offload_model:  # FSDP2's CPU offload: the step runs on the host
        p = dataclasses.replace(p, weights=0, gradients=0, optimizer=0, optimizer_temporary=0)
    return p.update_peak * HEADROOM


def auto_settings(max_length: int | None, checkpointing: bool | None, fused_head: bool | None, *, config,
                  device_type: str, free_bytes: int | None, lora_rank: int = 0, shards: int = 1,
                  tp_size: int = 1, offload_optimizer: bool = False, offload_model: bool = False,
                  reserved_bytes: int = 0, entropy: bool = False) -> AutoSettings:
    """Values for whichever of actor.max_length_per_device, actor.gradient_checkpointing and
    actor.use_liger_kernel are None (the module docstring's rule); set ones are kept as they are. With
    actor.offload_optimizer (offload_model) the moments (and weights and gradients) are not on the device.
    `reserved_bytes`: what the run's other models will hold (resident_bytes), taken off the free memory;
    `entropy`: an entropy bonus in the loss (the plain head holds its graph too)."""
    if None not in (max_length, checkpointing, fused_head):
        return AutoSettings(max_length, checkpointing, fused_head)
    if device_type != "cuda" or free_bytes is None:
        length = CPU_MAX_LENGTH if max_length is None else max_length
        return AutoSettings(length, bool(checkpointing), bool(fused_head),
                            f"on {device_type}: max_length_per_device {length}, gradient_checkpointing "
                            f"{'on' if checkpointing else 'off'}, fused head {'on' if fused_head else 'off'}")
    counts = count_parameters(config, lora_rank)
    free_bytes -= reserved_bytes

    def peak(seq: int, head: bool, ckpt: bool) -> float:
        return update_need(config, seq, fused_head=head, checkpointing=ckpt, lora_rank=lora_rank, shards=shards,
                           offload_optimizer=offload_optimizer, offload_model=offload_model, counts=counts,
                           entropy=entropy)

    applies = fused_head_applies(config, tp_size)

    def head_at(seq: int) -> bool:
        return fused_head if fused_head is not None else applies and seq >= LONG_MICRO_BATCH

    length = max_length
    if length is None:  # the longest that fits, checkpointing unless it is set off
        length = longest_fitting(range(1024, MAX_AUTO_LENGTH + 1, 1024),
                                 lambda s: peak(s, head_at(s), checkpointing is not False) <= free_bytes) or 1024
    head = head_at(length)
    ckpt = checkpointing if checkpointing is not None else peak(length, head, False) > free_bytes
    need = peak(length, head, ckpt)
    note = (f"max_length_per_device {length}{' (chosen)' if max_length is None else ''}, gradient_checkpointing "
            f"{'on' if ckpt else 'off'}{' (chosen)' if checkpointing is None else ''}, fused head "
            f"{'on' if head else 'off'}{' (chosen)' if fused_head is None else ''}: the update's estimated peak "
            f"{need / HEADROOM / GIB:.1f} GiB, {need / GIB:.1f} with 10% headroom, against {free_bytes / GIB:.1f} GiB "
            f"free{f' once the other models take {reserved_bytes / GIB:.1f}' if reserved_bytes else ''} "
            "(train/models/memory_plan.py)")
    if need > free_bytes:
        note += ("; it does not fit even so: LoRA (actor.lora.rank), actor.offload_optimizer=true or more GPUs "
                 "(FSDP shards the weights and the optimizer) would")
    return AutoSettings(length, ckpt, head, note)


def recompute_above(config, *, length: int, fused_head: bool, free_bytes: int, lora_rank: int = 0, shards: int = 1,
                    offload_optimizer: bool = False, offload_model: bool = False,
                    master_weights: bool = False, entropy: bool = False) -> int | None:
    """Where null actor.gradient_checkpointing came out on (the update at `length` tokens per micro-batch does
    not fit without it): the longest micro-batch, a multiple of 1024 below `length`, whose update fits
    `free_bytes` without checkpointing. Micro-batches up to it keep their activations and skip the recompute
    (a third more compute per layer); longer ones recompute. None when not even 1024 tokens fit without it."""
    counts = count_parameters(config, lora_rank)
    return longest_fitting(range(1024, length, 1024), lambda s: update_need(
        config, s, fused_head=fused_head, checkpointing=False, lora_rank=lora_rank, shards=shards,
        offload_optimizer=offload_optimizer, offload_model=offload_model, master_weights=master_weights,
        counts=counts, entropy=entropy) <= free_bytes)


def master_weights_fit(config, *, seq: int, lora_rank: int, fused_head: bool, checkpointing: bool,
                       free_bytes: int, offload_optimizer: bool = False, entropy: bool = False) -> bool:
    """Whether one GPU's update with `actor.master_weights` (bf16 copies held whole, `plan`) plus 10% fits
    `free_bytes` at the settings already chosen: the rule for actor.master_weights=null on a GPU."""
    p = plan(config, seq=seq, lora_rank=lora_rank, fused_head=fused_head, checkpointing=checkpointing,
             master_weights=True, entropy=entropy, offload_optimizer=offload_optimizer)
    return p.update_peak * HEADROOM <= free_bytes


def working_bytes(config, *, seq: int, lora_rank: int, fused_head: bool, checkpointing: bool, master_weights: bool,
                  shards: int = 1, moments: bool = False, sums_held: bool = False,
                  counts: tuple[int, int] | None = None, entropy: bool = False, lm_head: bool = True,
                  offload_optimizer: bool = False) -> int:
    """Device bytes per rank an update at `seq` tokens per micro-batch takes beyond the weights and AdamW moments
    that stay allocated between steps: its gradients with the activations and FSDP's unshard of the backward, or
    with the optimizer step's temporary, or the push's two buckets, whichever is most (`plan`'s phases, less what
    they share). `moments`: the AdamW moments too (before the first optimizer step, which allocates them).
    `sums_held` (with `master_weights`): the fp32 gradient sums are allocated already (after the first backward:
    they stay), so they are not counted again. `counts`: count_parameters(config, lora_rank), where the caller
    has it (it builds the model on the meta device). `entropy`, `lm_head`, `offload_optimizer` (no moments stay on
    the device; a bucket of them visits in the step): as `plan`'s."""
    p = plan(config, seq=seq, lora_rank=lora_rank, fused_head=fused_head, checkpointing=checkpointing,
             shards=shards, master_weights=master_weights, counts=counts, entropy=entropy, lm_head=lm_head,
             offload_optimizer=offload_optimizer)
    held = p.weights + p.optimizer + (4 * (p.adapters if lora_rank else p.params) // max(1, shards)
                                      if master_weights and sums_held else 0)
    return max(p.update_peak - held, p.push_buffers) + (p.optimizer if moments else 0)


def describe(name: str, p: MemoryPlan, seq: int, lora_rank: int) -> str:
    g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
    kind = f"LoRA rank {lora_rank} ({p.adapters / 1e6:.0f}M adapters)" if lora_rank else "full fine-tuning"
    lines = [f"{name}: {p.params / 1e9:.2f}B parameters, {kind}, {seq} tokens per micro-batch",
             f"  actor weights {g(p.weights)} GiB, gradients {g(p.gradients)}, AdamW moments {g(p.optimizer)}"
             + (f", step temporary {g(p.optimizer_temporary)}" if p.optimizer_temporary else ""),
             f"  update: activations {g(p.activations)} GiB, FSDP unshard {g(p.unshard)} -> peak {g(p.update_peak)} GiB",
             f"  rollout: engine's own weights {g(p.engine_weights)} GiB, KV cache {g(p.kv_cache)} -> peak "
             f"{g(p.rollout_peak)} GiB",
             f"  push: two buckets {g(p.push_buffers)} GiB -> peak {g(p.push_peak)} GiB"]
    lines.append("  fits (peak + 10%): " + ", ".join(f"{card} {'yes' if p.fits(gib) else 'no'}"
                                                     for card, gib in CARDS.items()))
    return "\n".join(lines)


# (preset, LoRA rank, actor.offload_optimizer)
TABLE_ROWS = (("qwen2.5-0.5b", 0, False), ("qwen3-4b", 0, False), ("qwen3-4b", 0, True), ("qwen3-4b", 32, False),
              ("llama3.1-8b", 0, False), ("llama3.1-8b", 0, True), ("llama3.1-8b", 32, False), ("qwen3-8b", 32, False),
              ("qwen3-32b", 32, False), ("qwen3-30b-a3b", 32, False))


def table(seqs: tuple[int, ...] = (16384, 32768)) -> str:
    """Markdown: the presets' peaks (GiB) and whether they fit each card, at each sequence length."""
    head = "| model | training | " + " | ".join(f"peak at {s // 1024}K (GiB) | fits 80 / 141 GB at {s // 1024}K"
                                                for s in seqs) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(seqs))]
    for name, rank, offload in TABLE_ROWS:
        config = preset_config(name)
        counts = count_parameters(config, rank)
        cells = []
        for s in seqs:
            p = plan(config, seq=s, lora_rank=rank, counts=counts, offload_optimizer=offload)
            cells += [f"{p.peak / GIB:.1f}", " / ".join("yes" if p.fits(g) else "no" for g in CARDS.values())]
        training = (f"LoRA r={rank}" if rank else "full") + (", moments offloaded" if offload else "")
        lines.append(f"| {name} | {training} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}) or a model folder")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--seq", type=int, default=16384, help="tokens per packed micro-batch (actor.max_length_per_device)")
    ap.add_argument("--replies", type=int, default=8, help="replies in flight in the engine")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per reply")
    ap.add_argument("--new", type=int, default=128, help="new tokens per reply")
    ap.add_argument("--no-share-base", action="store_true", help="the engine holds its own base (LoRA)")
    ap.add_argument("--plain-head", action="store_true", help="without the fused log-prob head")
    ap.add_argument("--entropy", action="store_true", help="an entropy bonus in the loss (actor.entropy.coef > 0)")
    ap.add_argument("--foreach", action="store_true", help="the foreach AdamW's step temporary (before fused)")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="actor.offload_optimizer: the AdamW moments on the host, one bucket on the GPU in the step")
    ap.add_argument("--bucket-mb", type=float, default=512, help="rollout.bucket_size_mb (the push's buckets)")
    ap.add_argument("--json", action="store_true", help="print the parts as JSON")
    ap.add_argument("--table", action="store_true", help="the presets' table (docs/gpu.md)")
    args = ap.parse_args(argv)
    if args.table:
        print(table())
        return 0
    if not args.model:
        ap.error("--model is required (or --table)")
    config = load_config(args.model)
    p = plan(config, seq=args.seq, lora_rank=args.lora_rank, share_base=not args.no_share_base,
             replies=args.replies, prompt=args.prompt, new=args.new, fused_head=not args.plain_head,
             foreach=args.foreach, bucket_mb=args.bucket_mb, entropy=args.entropy,
             offload_optimizer=args.offload_optimizer)
    # the longest micro-batch whose update fits each card without checkpointing (recompute_above's rule)
    plain = {card: recompute_above(config, length=args.seq + 1, fused_head=not args.plain_head,
                                   free_bytes=int(gib * GIB), lora_rank=args.lora_rank, entropy=args.entropy,
                                   offload_optimizer=args.offload_optimizer)
             for card, gib in CARDS.items()}
    if args.json:
        print(json.dumps({**p.__dict__, "update_peak": p.update_peak, "rollout_peak": p.rollout_peak,
                          "push_peak": p.push_peak, "no_recompute_up_to": plain}))
    else:
        print(describe(args.model, p, args.seq, args.lora_rank))
        print("  without checkpointing (the update alone, engine asleep): micro-batches up to " + ", ".join(
            f"{n if n is not None else 'none'} tokens on {card}" for card, n in plain.items())
            + " keep their activations; longer ones recompute")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
