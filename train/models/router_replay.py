"""Router replay for mixtures of experts (`actor.router_replay`, R3 in verl's terms).

A token can be routed to different experts when the sampler generates it and when the trainer
recomputes it (another batch shape, another kernel, bf16 rounding): its expert outputs differ, and so
does its log-prob, by far more than rounding. Replay makes the trainer take the sampler's choices:

- the `hf` engine records each position's top-k expert indices in every MoE layer
  (`RoutingRecorder`, forward hooks on the routers) and returns them with the sample;
- the sample carries them as one small integer tensor [positions, layers, top_k] (`sample_routes`);
- the actor's forward replays them (`RouterReplay`): each router still computes its logits and
  probabilities from the current weights (the router trains through its gate weights), but takes
  the recorded experts instead of its own top-k.

Modes: "response" replays the positions holding tokens the policy sampled; "all" also the prompt's
and the environment's tokens. A position with nothing recorded (or not replayed) holds `spec.none`,
and the router routes it itself. Entry t of a sample's routes is position t as input, the position
whose output predicts token t + 1: the trainer's per-token convention (train/parallel/packing.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

REPLAY_MODES = ("response", "all")  # actor.router_replay (null: off)


def _softmax_then_topk(normalize: Callable[[torch.nn.Module], bool], cast_back: bool):
    """Qwen2/Qwen3-MoE, OLMoE, Mixtral: softmax over all experts, top-k, optionally renormalised."""

    def route(router: torch.nn.Module, hidden: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        chosen = torch.where(recorded >= router.num_experts, own, recorded)
        top = probs.gather(-1, chosen)
        if normalize(router):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, (top.to(logits.dtype) if cast_back else top), chosen

    return route


def _topk_then_softmax(router: torch.nn.Module, hidden: torch.Tensor, recorded: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GPT-OSS: top-k over the biased logits, softmax over the k chosen."""
    logits = F.linear(hidden, router.weight, router.bias)
    own = torch.topk(logits, router.top_k, dim=-1).indices
    chosen = torch.where(recorded >= router.num_experts, own, recorded)
    top = logits.gather(-1, chosen)
    return logits, torch.softmax(top, dim=1, dtype=top.dtype), chosen


# Router classes whose routing rule is mirrored here (each checked against the class's own forward in
# tests/unit/test_router_replay.py: replaying the router's own choices gives its outputs bit for bit).
REPLAY_RULES: dict[str, Callable[..., tuple[torch.Tensor, ...]]] = {
    "Qwen3MoeTopKRouter": _softmax_then_topk(lambda r: r.norm_topk_prob, cast_back=True),
    "Qwen2MoeTopKRouter": _softmax_then_topk(lambda r: r.norm_topk_prob, cast_back=True),
    "OlmoeTopKRouter": _softmax_then_topk(lambda r: r.norm_topk_prob, cast_back=True),
    "MixtralTopKRouter": _softmax_then_topk(lambda r: True, cast_back=False),
    "GptOssTopKRouter": _topk_then_softmax,
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order: modules whose class name ends in 'TopKRouter' (the
    transformers 5 convention: forward(hidden) -> (logits, scores, top-k indices))."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@dataclass(frozen=True)
class RoutingSpec:
    """What a model's routing record looks like: [positions, layers, top_k] of `dtype`; `none` marks
    a position the router routes itself."""
    layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 255 else torch.int16  # `none` (the maximum) must not be an expert

    @property
    def none(self) -> int:
        return torch.iinfo(self.dtype).max  # >= num_experts: no expert has this index

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * self.dtype.itemsize

    def empty(self, positions: int) -> torch.Tensor:
        return torch.full((positions, self.layers, self.top_k), self.none, dtype=self.dtype)


def routing_spec(model: torch.nn.Module) -> RoutingSpec | None:
    """The routing record of `model` (None: a dense model); the same for every router or an error."""
    routers = moe_routers(model)
    if not routers:
        return None
    shapes = {(int(r.top_k), int(r.num_experts)) for r in routers}
    if len(shapes) > 1:
        raise ValueError(f"{type(model).__name__}: routers with different (top_k, experts) {sorted(shapes)}; "
                         "router replay records one shape per model")
    (top_k, experts), = shapes
    return RoutingSpec(len(routers), top_k, experts)


def replay_refusal(model: torch.nn.Module) -> str | None:
    """Why `model`'s routing cannot be replayed (None: it can)."""
    routers = moe_routers(model)
    if not routers:
        return (f"{type(model).__name__} is not a mixture of experts (no *TopKRouter module): there is no routing "
                "to replay; set actor.router_replay=null")
    unknown = sorted({type(r).__name__ for r in routers} - set(REPLAY_RULES))
    if unknown:
        return (f"no replay rule for the router {unknown[0]}; router replay supports {', '.join(sorted(REPLAY_RULES))} "
                "(train/models/router_replay.py)")
    return None


class RoutingRecorder:
    """Forward hooks on a model's routers that keep every call's top-k indices (in the spec's dtype, on
    the model's device) until `take()`: one [rows, layers, top_k] tensor per forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        spec = routing_spec(model)
        if spec is None:
            raise ValueError(f"{type(model).__name__} has no MoE routers to record")
        self.spec = spec
        self._calls: list[torch.Tensor] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in moe_routers(model)]

    def _hook(self, module: torch.nn.Module, args, output) -> None:
        self._calls.append(output[2].to(self.spec.dtype))

    def take(self) -> torch.Tensor:
        """The last forward's choices, [rows, layers, top_k]; the record starts empty again."""
        calls, self._calls = self._calls, []
        if len(calls) != self.spec.layers:
            raise RuntimeError(f"router replay: recorded {len(calls)} router calls in one forward, expected "
                               f"{self.spec.layers} (one per MoE layer)")
        return torch.stack(calls, dim=1)

    def clear(self) -> None:
        self._calls = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class RouterReplay:
    """Installed on the actor's model: while `routes` are set, each router takes its experts from them
    (positions marked `spec.none` route themselves); with none set, the routers are untouched.
    The routes stay set until the next `set` or `clear`, so activation checkpointing's recompute in the
    backward replays the same choices as the forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        refusal = replay_refusal(model)
        if refusal is not None:
            raise ValueError(f"actor.router_replay: {refusal}")
        self.spec = routing_spec(model)
        self._routes: torch.Tensor | None = None
        for layer, router in enumerate(moe_routers(model)):
            router.forward = self._replaying(layer, router, REPLAY_RULES[type(router).__name__])

    def _replaying(self, layer: int, router: torch.nn.Module, rule) -> Callable[[torch.Tensor], tuple]:
        own_forward = type(router).forward

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if self._routes is None:
                return own_forward(router, hidden_states)
            recorded = self._routes[:, layer]
            rows = hidden_states.numel() // hidden_states.shape[-1]
            if recorded.shape[0] != rows:
                raise RuntimeError(f"router replay: routes for {recorded.shape[0]} positions, the forward has {rows}")
            return rule(router, hidden_states, recorded.long())

        return forward

    def set(self, routes: torch.Tensor | None) -> None:
        """Routes [positions, layers, top_k] for the next forwards (None: the routers route themselves)."""
        self._routes = routes

    def clear(self) -> None:
        self._routes = None


def sample_routes(recorded: torch.Tensor | None, action_mask: list[int], mode: str, spec: RoutingSpec) -> torch.Tensor:
    """One sample's routes as the trainer reads them: [len - 1, layers, top_k], entry t = position t.
    `recorded` covers the positions the engine ran (a prefix; None: none); "response" keeps only
    positions holding tokens the policy sampled (`action_mask` per token), "all" every recorded one."""
    n = len(action_mask) - 1
    out = spec.empty(max(n, 0))
    if recorded is None or n <= 0:
        return out
    got = min(n, recorded.shape[0])
    out[:got] = recorded[:got].to(spec.dtype)
    if mode == "response":
        sampled = torch.tensor(action_mask[:n], dtype=torch.bool)
        out[~sampled] = spec.none
    elif mode != "all":
        raise ValueError(f"actor.router_replay: expected one of {', '.join(REPLAY_MODES)} or null, got {mode!r}")
    return out


class RouterBalance:
    """The routers' load-balancing loss (`actor.router_aux_loss_coef`), as transformers' MoE models compute
    it (`load_balancing_loss_func`): over the layers together, E * sum_e f_e * P_e, where f_e is the share
    of (token, top-k slot) choices that went to expert e and P_e the mean router probability of e. Forward
    hooks keep each router's logits and choices (replayed ones included) until `loss()`."""

    def __init__(self, model: torch.nn.Module) -> None:
        spec = routing_spec(model)
        if spec is None:
            raise ValueError(f"actor.router_aux_loss_coef: {type(model).__name__} is not a mixture of experts "
                             "(no *TopKRouter module); set it to 0")
        self.spec = spec
        self._calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = [r.register_forward_hook(self._hook) for r in moe_routers(model)]

    def _hook(self, module: torch.nn.Module, args, output) -> None:
        self._calls.append((output[0], output[2]))

    def clear(self) -> None:
        """Before a forward (activation checkpointing's recompute adds calls after the last loss)."""
        self._calls = []

    def loss(self, rows: int, row_total: int, sp_group=None) -> torch.Tensor:
        """The loss over a row's `row_total` real positions, of which the last forward (this rank's chunk) holds
        its first `rows` (the rest is padding). Under Ulysses (`sp_group`) the sums of every chunk are gathered
        (each rank's own part keeps its gradient), so every rank computes the whole row's loss. The counts are
        host integers: no device-to-host wait per micro-batch."""
        from train.parallel.seq_parallel import gather_sequence

        calls, self._calls = self._calls[: self.spec.layers], []
        if len(calls) != self.spec.layers:
            raise RuntimeError(f"router balance: {len(calls)} router calls in the forward, expected {self.spec.layers}")
        device = calls[0][0].device
        experts = self.spec.num_experts
        counts = torch.zeros(experts, device=device)
        probs = torch.zeros(experts, device=device)
        for logits, chosen in calls:
            picked = chosen[:rows].reshape(-1).long()
            counts.scatter_add_(0, picked, torch.ones(picked.numel(), device=device))
            probs = probs + torch.softmax(logits[:rows].float(), dim=-1).sum(0)
        if row_total == 0:  # a padding pack (on every sp rank alike): no real position
            return probs.sum() * 0.0
        sums = gather_sequence(torch.cat([counts, probs])[None], sp_group).sum(0)
        total = float(row_total * len(calls))
        return experts * torch.sum((sums[:experts] / total) * (sums[experts:] / total))


def dispatch_routes(samples: list, mode: str, spec: RoutingSpec) -> dict:
    """The keyword arguments of train/parallel/step_batch.py::dispatch that carry `samples`' routes
    (each with `.routing` and `.action_mask`, train/workers/rollout.py's Sample) to the actor's batch."""
    return {"routing": [sample_routes(s.routing, s.action_mask, mode, spec) for s in samples],
            "route_shape": (spec.layers, spec.top_k), "route_dtype": spec.dtype}
