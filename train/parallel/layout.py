"""Device meshes for one model (actor, critic or reference), built from its config sizes.

    model mesh (ddp, fsdp, tp): how parameters are held. FSDP2 replicates over `ddp` and shards
        over `fsdp` (hybrid sharding when both are > 1); tensor parallelism splits over `tp`.
    data mesh (dp, sp, tp): how work is spread. Ranks that share a `dp` index hold the same
        samples; `sp` ranks split each packed sequence (Ulysses), `tp` ranks see the same tokens.
        With ring attention (cp > 1) it is (dp, cp, sp, tp): a row is split over the cp x sp ranks
        (flattened as "seq"), Ulysses inside each ring rank's chunk, the ring over cp.

    world = ddp * fsdp * tp = dp * sp * cp * tp. Ranks are laid out tp-innermost in both meshes, so a
    tp group is the same set of ranks in each; sp ranks sit inside the FSDP dimensions (they hold
    the same parameters and their gradients are reduced with the data-parallel ones).

    With expert parallelism (ep > 1, mixtures of experts) the model mesh is (ddp, efsdp, ep, tp):
    fsdp = efsdp * ep, flattened, still shards the dense parameters; routed experts are split over
    `ep` and FSDP-sharded over (ddp, efsdp) (train/parallel/expert_parallel.py). ep ranks are
    consecutive, so an ep group sits inside a node where it can.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from train.parallel.distributed import mesh_overrides
from train.parallel.expert_parallel import ep_refusal
from train.parallel.tensor_parallel import expert_count, tp_refusal


# model types ring attention cannot run, and why (checked at start-up from config.json)
RING_REFUSED = {"gpt_oss": "ring attention has no attention-sink column (GPT-OSS's sinks)"}


class LayoutError(ValueError):
    """Sizes that cannot be laid out on this world or this model; the message names the key."""


@dataclass(frozen=True)
class Sizes:
    ddp: int
    fsdp: int
    tp: int
    sp: int
    dp: int
    ep: int = 1
    cp: int = 1

    @property
    def seq(self) -> int:
        """The ranks a packed row is split over: Ulysses' sp times the ring's cp."""
        return self.sp * self.cp


def layout_sizes(world: int, ddp: int = 1, tp: int = 1, sp: int = 1, prefix: str = "actor", ep: int = 1,
                 cp: int = 1) -> Sizes:
    """Derive fsdp and dp from the world size and the user's ddp/tp/sp/ep/cp, or say which key is wrong."""
    for key, value in (("ddp_size", ddp), ("tp_size", tp), ("sp_size", sp), ("ep_size", ep), ("cp_size", cp)):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{prefix}.{key}: must be a positive integer, got {value!r}")
    if world % tp:
        raise LayoutError(f"{prefix}.tp_size={tp} does not divide the {world} ranks; pick a divisor of {world}")
    if cp > 1 and world % (cp * sp * tp):
        raise LayoutError(f"{prefix}.cp_size={cp} x {prefix}.sp_size={sp} x {prefix}.tp_size={tp} does not divide "
                          f"the {world} ranks; their product must divide the world size")
    if world % (tp * sp):
        raise LayoutError(f"{prefix}.sp_size={sp} x {prefix}.tp_size={tp} does not divide the {world} ranks; "
                          f"their product must divide the world size")
    if (world // tp) % ddp:
        raise LayoutError(f"{prefix}.ddp_size={ddp} does not divide the {world // tp} data-parallel ranks "
                          f"(world {world} / tp_size {tp}); use a divisor of {world // tp}")
    fsdp = world // (tp * ddp)
    if ep > 1 and tp > 1:
        raise LayoutError(f"{prefix}.ep_size={ep} with {prefix}.tp_size={tp}: experts are split over ep "
                          f"and the rest sharded with FSDP; set {prefix}.tp_size=1")
    if fsdp % ep:
        raise LayoutError(f"{prefix}.ep_size={ep} does not divide the {fsdp} FSDP ranks (world {world} / "
                          f"ddp_size {ddp} / tp_size {tp}); use a divisor of {fsdp}")
    return Sizes(ddp=ddp, fsdp=fsdp, tp=tp, sp=sp, dp=world // (tp * sp * cp), ep=ep, cp=cp)


def check_model_fits(sizes: Sizes, model_config, prefix: str = "actor") -> None:
    """Heads and vocabulary must split evenly over tp (and heads over tp * sp for Ulysses), and the
    architecture must have a tensor-parallel plan. A vision-language model trains on data-parallel layouts
    (FSDP / HSDP) only: an image's placeholder run must stay whole on one rank."""
    if getattr(model_config, "vision_config", None) is not None:
        split = {k: v for k, v in (("tp_size", sizes.tp), ("sp_size", sizes.sp), ("cp_size", sizes.cp),
                                   ("ep_size", sizes.ep)) if v > 1}
        if split:
            key, value = next(iter(split.items()))
            raise LayoutError(f"{prefix}.{key}={value}: {type(model_config).__name__} is a vision-language model, "
                              "which trains with FSDP / HSDP (data parallel) only here: its images' placeholder "
                              f"tokens must stay whole on one rank; set {prefix}.{key}=1")
        model_config = model_config.get_text_config()
    if sizes.tp > 1:
        reason = tp_refusal(model_config)
        if reason is not None:
            raise LayoutError(f"{prefix}.tp_size={sizes.tp}: {reason}; set {prefix}.tp_size=1")
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % (sizes.tp * sizes.sp):
        raise LayoutError(f"{prefix}: {heads} attention heads do not split over tp_size={sizes.tp} x "
                          f"sp_size={sizes.sp}; each must divide the head count ({heads})")
    if kv_heads % sizes.tp:
        raise LayoutError(f"{prefix}.tp_size={sizes.tp}: {kv_heads} key/value heads do not split evenly; "
                          f"use a tp_size that divides {kv_heads}")
    if model_config.vocab_size % sizes.tp:
        raise LayoutError(f"{prefix}.tp_size={sizes.tp}: the vocabulary ({model_config.vocab_size}) does not "
                          f"split evenly for the vocab-parallel lm_head")
    if sizes.cp > 1 and getattr(model_config, "model_type", "") in RING_REFUSED:
        raise LayoutError(f"{prefix}.cp_size={sizes.cp}: {RING_REFUSED[model_config.model_type]}; set "
                          f"{prefix}.cp_size=1 (or sp_size for Ulysses)")
    if sizes.ep > 1:
        experts = expert_count(model_config)
        reason = ep_refusal(model_config) if experts else (f"{type(model_config).__name__} is not a mixture of "
                                                          "experts")
        if reason is not None:
            raise LayoutError(f"{prefix}.ep_size={sizes.ep}: {reason}; set {prefix}.ep_size=1")
        if experts % sizes.ep:
            raise LayoutError(f"{prefix}.ep_size={sizes.ep}: {experts} experts per layer do not split evenly; "
                              f"use a divisor of {experts}")


@dataclass
class Layout:
    """One model's meshes and this rank's place in them."""
    sizes: Sizes
    model_mesh: DeviceMesh  # ("ddp", "fsdp", "tp"); with ep > 1 ("ddp", "efsdp", "ep", "tp"), fsdp flattened
    data_mesh: DeviceMesh  # ("dp", "sp", "tp"); with cp > 1 ("dp", "cp", "sp", "tp"), (cp, sp) flattened as "seq"

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What fully_shard runs over: (ddp, fsdp) for hybrid sharding, else fsdp alone."""
        return self.model_mesh["ddp", "fsdp"] if self.sizes.ddp > 1 else self.model_mesh["fsdp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """What routed experts are split over (ep > 1 only)."""
        return self.model_mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards each rank's block of experts over (ep > 1 only): (ddp, efsdp), or efsdp alone."""
        return self.model_mesh["ddp", "efsdp"] if self.sizes.ddp > 1 else self.model_mesh["efsdp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.model_mesh["tp"]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.model_mesh["tp"].get_group()

    @property
    def ring(self) -> int:
        """The ring attention's size (cp; 0 without): packed rows are split zigzag over its ranks."""
        return self.sizes.cp if self.sizes.cp > 1 else 0

    @property
    def _seq_mesh(self) -> DeviceMesh:
        return self.data_mesh["seq"] if self.ring else self.data_mesh["sp"]

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """Every rank a packed row is split over (sp, or cp x sp): per-token outputs are gathered over it."""
        return self._seq_mesh.get_group()

    def attention_groups(self) -> dict:
        """The model's attention keywords: `sp_group` for Ulysses' all-to-alls, `cp_group` for the ring."""
        if not self.ring:
            return {"sp_group": self.sp_group}
        return {"sp_group": self.data_mesh["sp"].get_group() if self.sizes.sp > 1 else None,
                "cp_group": self.data_mesh["cp"].get_group()}

    @property
    def dp_rank(self) -> int:
        return self.data_mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        return self._seq_mesh.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.data_mesh.get_local_rank("tp")

    @property
    def is_data_leader(self) -> bool:
        """The one rank of its dp group that reports metrics and counts tokens (the others see the
        same samples: counting them too would multiply by sp * tp)."""
        return self.sp_rank == 0 and self.tp_rank == 0

    @property
    def grad_scale(self) -> int:
        """FSDP averages gradients over the ddp * fsdp ranks; losses are multiplied by this to undo it
        (normalisers are already global)."""
        return self.sizes.ddp * self.sizes.fsdp


def build_layout(world: int, device_type: str, ddp: int = 1, tp: int = 1, sp: int = 1,
                 prefix: str = "actor", timeout_s: float | None = None, ep: int = 1, cp: int = 1) -> Layout:
    """Both meshes for one model; a collective (every rank calls it, in the same order). Their
    groups time out after `timeout_s` (None: torch's default)."""
    sizes = layout_sizes(world, ddp, tp, sp, prefix, ep, cp)
    if sizes.ep > 1:
        model_dims, shape = ("ddp", "efsdp", "ep", "tp"), (sizes.ddp, sizes.fsdp // sizes.ep, sizes.ep, sizes.tp)
    else:
        model_dims, shape = ("ddp", "fsdp", "tp"), (sizes.ddp, sizes.fsdp, sizes.tp)
    model_mesh = init_device_mesh(device_type, shape, mesh_dim_names=model_dims,
                                  backend_override=mesh_overrides(device_type, model_dims, timeout_s))
    if sizes.ep > 1:  # the dense parameters' fsdp dimension: efsdp x ep as one
        override = mesh_overrides(device_type, ("fsdp",), timeout_s)
        model_mesh["efsdp", "ep"]._flatten("fsdp", backend_override=override and override["fsdp"])
    if sizes.cp > 1:
        data_dims, shape = ("dp", "cp", "sp", "tp"), (sizes.dp, sizes.cp, sizes.sp, sizes.tp)
    else:
        data_dims, shape = ("dp", "sp", "tp"), (sizes.dp, sizes.sp, sizes.tp)
    data_mesh = init_device_mesh(device_type, shape, mesh_dim_names=data_dims,
                                 backend_override=mesh_overrides(device_type, data_dims, timeout_s))
    if sizes.cp > 1:  # the ranks a row is split over, ring-major
        override = mesh_overrides(device_type, ("seq",), timeout_s)
        data_mesh["cp", "sp"]._flatten("seq", backend_override=override and override["seq"])
    return Layout(sizes, model_mesh, data_mesh)


def layout_for(section, world: int, device_type: str, prefix: str, timeout_s: float | None = None) -> Layout:
    """A model's layout from its config section (`ddp_size`, `tp_size`, `sp_size`, `ep_size`, `cp_size`;
    absent or null = 1)."""
    size = lambda key: getattr(section, key, None) or 1  # noqa: E731
    return build_layout(world, device_type, ddp=size("ddp_size"), tp=size("tp_size"), sp=size("sp_size"),
                        prefix=prefix, timeout_s=timeout_s, ep=size("ep_size"), cp=size("cp_size"))
