"""One model a Tinker client trains: its weights (a LoRA adapter on a base model, or all of them), its Adam
state and its accumulated gradients, and the operations the API runs on it.

Every rank holds one shard of each model (FSDP2 over the ranks, `train.parallel.parallelize.apply_fsdp`) and
runs the same operation with the same arguments (train/tinker_service/ranks.py broadcasts them). A
`forward_backward` splits its datums over the ranks; each datum's loss is Tinker's sum over its tokens, and
the gradient is the sum over every datum of every call since the last `optim_step` (FSDP averages over ranks,
so each rank's loss is scaled by the world size). Memory per rank: base weights / N, plus the adapter, its
gradient and Adam's two moments (LoRA), or the full model's / N (full fine-tuning).
"""
from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from train.algorithms.logits import logprobs_from_logits
from train.models.lora import LoraSettings, apply_lora, is_adapter
from train.models.optim import clip_grad_norm
from train.tinker_service.errors import ClientError
from train.tinker_service.losses import LOSSES, check_request, cross_entropy_terms, datum_loss
from train.tinker_service.wire import Datum

LORA_ALPHA = 32.0  # Tinker's LoRA scaling is alpha / rank with a fixed alpha
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdamStep:
    """The SDK's AdamParams: one optimizer step's hyperparameters (Tinker sends them with every step)."""
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


def lora_settings(rank: int, train_attn: bool = True, train_mlp: bool = True) -> LoraSettings:
    """The adapter a CreateModelRequest's lora_config asks for. `train_unembed` has no counterpart: the
    trainer's output head takes no adapter (train.models.lora refuses lm_head)."""
    targets = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    if rank < 1 or not targets:
        raise ClientError(f"lora_config: rank must be >= 1 and train_attn or train_mlp true, got rank={rank}")
    return LoraSettings(rank=rank, alpha=LORA_ALPHA, target_modules=targets)


def lora_of(config: dict | None) -> LoraSettings | None:
    """A CreateModelRequest's `lora_config` (as JSON; None: every weight trains) as the trainer's settings."""
    if config is None:
        return None
    return lora_settings(int(config.get("rank", 0)), config.get("train_attn", True), config.get("train_mlp", True))


def load_base(path: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig

    from train.models.vlm import model_class

    model = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    return model.to(device)


def share_base(base: torch.nn.Module) -> torch.nn.Module:
    """A copy of `base` whose weights are `base`'s own tensors (not copies): every LoRA model on one base model
    holds the frozen base once, and only its adapter (and Adam's state for it) on its own."""
    return copy.deepcopy(base, memo={id(t): t for t in [*base.parameters(), *base.buffers()]})


class TrainedModel:
    def __init__(self, base_path: str, lora: LoraSettings | None, seed: int, device: torch.device,
                 mesh: Any = None, max_tokens: int | None = None, shared: torch.nn.Module | None = None,
                 micro_batch_tokens: int = 16384) -> None:
        """`shared`: the base model already loaded, to share its weights (LoRA on one rank only: under FSDP each
        model shards its own parameters). `micro_batch_tokens`: see `_micro_batches`."""
        self.micro_batch_tokens = micro_batch_tokens
        self.base_path, self.lora, self.device = base_path, lora, device
        self.model = share_base(shared) if shared is not None else load_base(base_path, device)
        self.max_tokens = max_tokens or getattr(self.model.config, "max_position_embeddings", None)
        if lora is not None:
            # the adapter's initial A: reproducible per lora_config.seed (drawn on the CPU); every device's
            # generator is put back after, as torch.manual_seed reseeds the GPU's too
            cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=cuda):
                torch.manual_seed(seed)
                apply_lora(self.model, lora, key="lora_config")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if mesh is not None and self.world > 1:
            from train.parallel.parallelize import apply_fsdp

            apply_fsdp(self.model, mesh)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.steps = 0

    # ------------------------------------------------------------------ forward / backward

    def forward_backward(self, data: list[Datum], loss_fn: str, config: dict, forward_only: bool
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Tinker's forward_backward on `data` (every rank is passed all of it and takes its share);
        returns each datum's outputs (`logprobs`, and `elementwise_loss` for cross_entropy) and `loss:sum`."""
        check_request(loss_fn, config)
        for i, d in enumerate(data):
            self._check_datum(i, d, loss_fn)
        mine = list(range(self.rank, len(data), self.world))
        parts = self._micro_batches(data, mine)
        count = len(parts)
        if self.world > 1:  # FSDP's collectives need every rank to run as many forwards (and backwards)
            n = torch.tensor([count], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            count = int(n)
        self.model.eval()  # no dropout: a forward_backward is a deterministic function of the weights
        loss_sum = 0.0
        outputs: dict[int, dict[str, np.ndarray]] = {}
        for part in [*parts, *[[] for _ in range(count - len(parts))]]:
            with torch.set_grad_enabled(not forward_only):
                total = self._part(data, part, loss_fn, config, outputs)
                if not forward_only:
                    # FSDP averages gradients over ranks; Tinker's loss is a sum over every datum.
                    (total * self.world).backward()
            loss_sum += float(total.detach())
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, (outputs, loss_sum))
            outputs = {k: v for part, _ in gathered for k, v in part.items()}
            loss_sum = sum(s for _, s in gathered)
        return [outputs[i] for i in range(len(data))], {"loss:sum": loss_sum}

    def _micro_batches(self, data: list[Datum], mine: list[int]) -> list[list[int]]:
        """This rank's datums in consecutive groups whose padded size (rows x longest) stays within
        `micro_batch_tokens`, so a forward's activations are bounded whatever a request holds (Tinker sends up
        to 1024 datums per call); a longer datum goes alone."""
        parts: list[list[int]] = []
        longest = 0
        for i in mine:
            n = len(data[i].tokens)
            if parts and max(longest, n) * (len(parts[-1]) + 1) <= self.micro_batch_tokens:
                parts[-1].append(i)
                longest = max(longest, n)
            else:
                parts.append([i])
                longest = n
        return parts

    def _part(self, data: list[Datum], part: list[int], loss_fn: str, config: dict,
              outputs: dict[int, dict[str, np.ndarray]]) -> torch.Tensor:
        """One micro-batch's summed loss; each datum's outputs go to `outputs`. An empty part (a rank with fewer
        micro-batches than another) runs a zero-loss forward so every rank issues the same collectives."""
        if not part:
            return self._anchor()
        total = torch.zeros((), device=self.device)
        for i, logp in zip(part, self._logprobs([data[i] for i in part])):
            inputs = {k: torch.as_tensor(v, dtype=torch.float32, device=self.device)
                      for k, v in data[i].inputs.items() if k != "target_tokens"}
            total = total + datum_loss(loss_fn, logp, inputs, config)
            out = {"logprobs": logp.detach().float().cpu().numpy()}
            if loss_fn == "cross_entropy":
                out["elementwise_loss"] = cross_entropy_terms(logp.detach(), inputs).cpu().numpy()
            outputs[i] = out
        return total

    def _check_datum(self, i: int, d: Datum, loss_fn: str) -> None:
        n = len(d.tokens)
        if n == 0:
            raise ClientError(f"data[{i}].model_input is empty")
        if self.max_tokens is not None and n > self.max_tokens:
            raise ClientError(f"data[{i}].model_input has {n} tokens, more than the model's context of "
                              f"{self.max_tokens}")
        vocab = self.model.config.get_text_config().vocab_size
        for name in ("target_tokens", *LOSSES[loss_fn].inputs):
            if name not in d.inputs:
                raise ClientError(f"data[{i}].loss_fn_inputs lacks {name!r}, which loss_fn={loss_fn!r} needs")
        for name, value in d.inputs.items():
            if value.shape != (n,):
                raise ClientError(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(value.shape)}; "
                                  f"model_input has {n} tokens, so it must be [{n}]")
            if not np.isfinite(value).all():
                raise ClientError(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or infinity")
        ids = np.asarray(d.tokens + d.inputs["target_tokens"].astype(np.int64).tolist())
        if ids.min() < 0 or ids.max() >= vocab:
            raise ClientError(f"data[{i}]: token id {int(ids.max() if ids.max() >= vocab else ids.min())} is "
                              f"outside the vocabulary [0, {vocab})")

    def _logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """log p(target_tokens[t] | model_input[:t+1]) for each datum, one right-padded forward."""
        if not data:
            return []
        width = max(len(d.tokens) for d in data)
        ids = torch.zeros(len(data), width, dtype=torch.long)
        targets = torch.zeros(len(data), width, dtype=torch.long)
        attention = torch.zeros(len(data), width, dtype=torch.long)
        for r, d in enumerate(data):
            n = len(d.tokens)
            ids[r, :n] = torch.tensor(d.tokens)
            targets[r, :n] = torch.as_tensor(d.inputs["target_tokens"].astype(np.int64))
            attention[r, :n] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
        logp = logprobs_from_logits(logits.float(), targets.to(self.device))
        return [logp[r, :len(d.tokens)] for r, d in enumerate(data)]

    def _anchor(self) -> torch.Tensor:
        """A rank with no datum in this call still runs forward and backward (FSDP's collectives need every
        rank), on one token with a zero loss."""
        logits = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits
        return logits.float().sum() * 0.0

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps,
                         weight_decay=step.weight_decay)
        metrics: dict[str, float] = {}
        if step.grad_clip_norm > 0:
            metrics["grad_norm"] = float(clip_grad_norm(self.params, step.grad_clip_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return metrics

    # ------------------------------------------------------------------ checkpoints

    def _state(self, with_optimizer: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=self.lora is not None)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        state: dict[str, Any] = {"model": model_state}
        if with_optimizer:
            state["optimizer"] = optim_state
        return state

    def save(self, folder: str) -> None:
        """A DCP checkpoint of the trained weights and Adam's state (each rank writes its own shards), written
        to `folder`.tmp and renamed, so a crash never leaves a half-written checkpoint under `folder`."""
        import torch.distributed.checkpoint as dcp

        tmp = folder + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.world > 1:
            dist.barrier()
        dcp.save(self._state(True), checkpoint_id=tmp)
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            with open(os.path.join(tmp, "steps"), "w") as f:
                f.write(str(self.steps))
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        if self.world > 1:
            dist.barrier()

    def load(self, folder: str, with_optimizer: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        state = self._state(True)
        if not with_optimizer:
            state.pop("optimizer")
        dcp.load(state, checkpoint_id=folder)
        # A LoRA checkpoint holds the adapter only: the frozen base comes from the base model's files.
        options = StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)
        if with_optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"], options=options)
        else:
            set_model_state_dict(self.model, state["model"], options=options)
        if with_optimizer:
            with open(os.path.join(folder, "steps")) as f:
                self.steps = int(f.read())
        self.optimizer.zero_grad(set_to_none=True)

    def sampler_weights(self) -> dict[str, torch.Tensor] | None:
        """What a sampler needs (the adapter, or every weight), gathered whole: a collective, and rank 0 keeps
        the result (CPU tensors); other ranks get None."""
        out = {}
        for name, value in self.model.state_dict().items():
            if self.lora is not None and not is_adapter(name):
                continue
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if self.rank == 0:
                out[name] = full.detach().to("cpu", copy=True)
        return out if self.rank == 0 else None
