"""Next-token log-probs and entropy straight from hidden states and the lm_head weight, a chunk of
tokens at a time (`actor.use_liger_kernel`): the [batch, seq, vocab] logits, their float32 copy and
the softmax the plain path keeps for backward are never materialised (for a 150k vocabulary and 16k
tokens that is ~10 GB each in float32).

- `fused_logprobs_entropy`: one pass gives both outputs; a custom backward recomputes each chunk's
  logits and forms the gradient of `g_logp * logp + g_ent * entropy` in closed form:
  d logp_y / dz = onehot(y) - p, d H / dz = -p (z - E_p[z]), with z = logits / T.
  Plain torch, so it runs (and is tested against the plain path) on CPU as well as GPU.
- On CUDA with liger-kernel installed, log-prob-only passes (reference / old log-probs, no grad)
  use liger's fused linear cross-entropy kernel (`reduction="none"` gives -logp per token).
- `FusedLogprobHead` plugs this into a Hugging Face causal LM without touching its parameters:
  for one forward it swaps the `lm_head` module's `forward` for the fused computation, so under
  FSDP2 the head still runs inside the root module's forward (weights gathered, gradients reduced)
  and the model returns log-probs (and entropy) in place of logits.
Requires an unsharded lm_head (actor tensor parallel size 1) without bias or logit post-processing.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

DEFAULT_CHUNK_TOKENS = 2048
WEIGHT_GRAD_ROWS = 16384  # vocabulary rows per matmul of a trained head's gradient: its bf16 and float32 temporaries
ENTROPY_BLOCKS = 8  # the forward's entropy sums run over an eighth of a chunk's rows at a time


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # The plain path's order: matmul in the parameter dtype, then float32, then / T (in place: a fresh tensor).
    z = (h @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


# Each [chunk, vocab] float32 temporary is ~1.2 GB at 2048 tokens and a 150k vocabulary, so a chunk's work runs in
# a function of its own (its temporaries are gone before the next chunk's logits are made) and reuses storage in
# place. The forward keeps each token's logsumexp (and entropy), so the backward makes the softmax as
# exp(z - lse) in the logits' own storage: forward and backward hold one such tensor (two with the entropy's
# term in the backward), which `head_bytes` in train/models/memory_plan.py counts and
# tests/integration/test_fused_logprobs.py measures.

def _forward_chunk(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-probs of `labels`, logsumexp, entropy or None) of one chunk. The logsumexp as torch's (the row's max
    out, exp, sum, log, the max back), with exp(z - max) in the logits' own storage. The entropy,
    H = lse - sum(e z) / sum(e) with e = exp(z - max), needs the logits and their exponentials at once: those are
    made ENTROPY_BLOCKS blocks of rows at a time, so the chunk holds its float32 logits and an eighth more."""
    z = _chunk_logits(h, weight, temperature)
    picked = z.gather(1, labels[:, None]).squeeze(1)
    top = z.amax(dim=-1, keepdim=True)
    if not with_entropy:
        lse = (z.sub_(top).exp_().sum(-1, keepdim=True).log() + top).squeeze(1)
        return picked - lse, lse, None
    total, weighted = torch.empty_like(top), torch.empty_like(top)
    rows = -(-z.shape[0] // ENTROPY_BLOCKS)
    for r in range(0, z.shape[0], rows):
        block = slice(r, r + rows)
        e = (z[block] - top[block]).exp_()
        total[block] = e.sum(-1, keepdim=True)
        weighted[block] = e.mul_(z[block]).sum(-1, keepdim=True)
    lse = (total.log() + top).squeeze(1)
    return picked - lse, lse, lse - (weighted / total).squeeze(1)


def _backward_chunk(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                    lse: torch.Tensor, entropy: torch.Tensor | None, g_logp: torch.Tensor | None,
                    g_ent: torch.Tensor | None) -> torch.Tensor:
    """d loss / d logits of one chunk (in the parameter dtype): g_logp (onehot(y) - p) - g_ent p (z - E_p[z]),
    over T, with the logits recomputed; p = exp(z - lse) and E_p[z] = lse - entropy from the forward."""
    z = _chunk_logits(h, weight, temperature)
    if g_ent is not None:
        gz = (z - lse[:, None]).exp_()  # p; z stays for the entropy's term
        mean_z = (lse - entropy)[:, None]
        z.sub_(mean_z).mul_(gz).mul_(g_ent[:, None].float())  # z := g_ent p (z - E_p[z])
    else:
        gz = z.sub_(lse[:, None]).exp_()  # p, in the logits' storage
        z = None
    if g_logp is not None:
        g = g_logp[:, None].float()
        gz.mul_(-g).scatter_add_(1, labels[:, None], g)
    else:
        gz.zero_()
    if z is not None:
        gz.sub_(z)
        del z
    if temperature != 1.0:
        gz.div_(temperature)
    return gz.to(h.dtype)  # back through the float32 cast, like autograd on the plain path


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logp[s:s + chunk], lse[s:s + chunk], ent = _forward_chunk(
                hidden[s:s + chunk], weight, labels[s:s + chunk], temperature, with_entropy)
            if with_entropy:
                entropy[s:s + chunk] = ent
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        # An output the loss does not use (the entropy, detached at actor.entropy.coef 0) gets None, not zeros:
        # the backward then skips its term (a [chunk, vocab] float32 temporary and three passes per chunk).
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        g_ent = g_ent if ctx.with_entropy else None
        for s in range(0, hidden.shape[0], chunk):
            part = slice(s, s + chunk)
            h = hidden[part]
            gz = _backward_chunk(h, weight, labels[part], T, lse[part], entropy[part] if g_ent is not None else None,
                                 None if g_logp is None else g_logp[part], None if g_ent is None else g_ent[part])
            if need_h:
                grad_h[part] = gz @ weight
            if need_w:  # a slice of the vocabulary at a time: [rows, hidden] temporaries, not [vocab, hidden]
                for v in range(0, grad_w.shape[0], WEIGHT_GRAD_ROWS):
                    grad_w[v:v + WEIGHT_GRAD_ROWS] += (gz[:, v:v + WEIGHT_GRAD_ROWS].t() @ h).float()
            del gz
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    use_liger: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h W^T / T)[label] and the entropy of softmax(h W^T / T), per position.

    `hidden` [..., H], `weight` [V, H], `labels` [...] (valid ids everywhere) -> float32 [...].
    `use_liger` None: liger-kernel for no-grad log-prob-only calls on CUDA when it is installed."""
    shape = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if use_liger is None:
        use_liger = not with_entropy and not needs_grad and hidden.is_cuda and liger_available()
    if use_liger and not with_entropy:
        return liger_logprobs(h, weight, y, temperature).reshape(shape), None
    logp, entropy = _ChunkedLogprobEntropy.apply(h, weight, y, float(temperature), int(chunk_tokens), with_entropy)
    return logp.reshape(shape), (entropy.reshape(shape) if with_entropy else None)


@functools.cache  # a failed import is not cached by Python: asked once per pack, it would be tried every time
def liger_available() -> bool:
    try:
        import liger_kernel.transformers.functional  # noqa: F401  (needs triton)
    except Exception:  # ImportError, or triton failing without a GPU
        return False
    return True


def liger_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """-cross_entropy per token from liger's fused linear cross-entropy; h / T gives logits / T."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden / temperature if temperature != 1.0 else hidden
    loss = liger_fused_linear_cross_entropy(h.contiguous(), weight.contiguous(), labels, reduction="none")
    return -loss.float()


class FusedLogprobHead:
    """See the module docstring. Call it instead of `model(...).logits` + log_softmax."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        check_supported(model)
        self.chunk_tokens = chunk_tokens

    def __call__(self, model: torch.nn.Module, labels: torch.Tensor, temperature: float, with_entropy: bool,
                 **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs, entropy or None) of `labels` [b, k] at the positions the lm_head sees: the
        model's forward with `model_kwargs` (typically `logits_to_keep` = the label positions)."""
        head = model.get_output_embeddings()

        def fused_forward(hidden: torch.Tensor) -> torch.Tensor:
            logp, ent = fused_logprobs_entropy(hidden, head.weight, labels, temperature,
                                               with_entropy=with_entropy, chunk_tokens=self.chunk_tokens)
            return torch.stack([logp, ent], dim=-1) if with_entropy else logp[..., None]

        previous = head.__dict__.get("forward")
        head.forward = fused_forward  # an instance attribute, for this call only
        try:
            packed = model(**model_kwargs).logits
        finally:
            if previous is None:
                del head.forward
            else:
                head.forward = previous
        return packed[..., 0], (packed[..., 1] if with_entropy else None)


def check_supported(model: torch.nn.Module) -> None:
    """The fused head replaces `logits = lm_head(h)`; models that post-process logits are refused."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError("actor.use_liger_kernel: the model has no nn.Linear output head (lm_head)")
    if head.bias is not None:
        raise ValueError("actor.use_liger_kernel: an lm_head with a bias is not supported")
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"actor.use_liger_kernel: {type(model).__name__} post-processes its logits "
                             f"({attr}); use the plain path (actor.use_liger_kernel=false)")
