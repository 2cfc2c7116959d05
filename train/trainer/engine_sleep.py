"""Whether the rollout engine frees its device memory while the models update (`rollout.sleep`).

On a GPU the `hf` engine's `sleep()` moves the weights it owns to pinned host memory, drops its KV buffers and
CUDA graphs and empties the allocator's cache; `wake()` copies the weights back, and the next rollout captures
its graphs again (every one of them, since the weights moved). That costs time at every step: worth it where the
update needs the memory (a big model, a long micro-batch), not where the update fits beside the engine (a 0.5B
model on an 80 GB card).

- `rollout.sleep=true`: the engine sleeps after every rollout (what it always did before this setting).
- `false`: it never does; the update runs beside it.
- `null` (the default): on a GPU, after each rollout, the engine stays awake when the free device memory of
  every rank (what the driver reports free plus what the allocator holds unused) covers the actor's update
  working bytes with 10% headroom (train/models/memory_plan.py `working_bytes`: gradients, activations, the
  push's buckets, at the longest micro-batch this step's batch can make: the configured length, or the
  batch's tokens over all ranks where those are fewer; before the first optimizer step the AdamW moments it
  will allocate; with a critic, the sum of its and the actor's); every rank decides alike (two all-reduces of
  one number: the batch's tokens, the shortfall). So a run whose `actor.max_length_per_device` was chosen long
  (null on a GPU: up to 65,536) keeps the engine awake through the steps whose batch is short. It sleeps where
  the plan has no estimate (`Trainable.update_working_bytes` is None: a vision-language model, ep / tp /
  sp / cp, actor.offload_model) and with SGLang (its KV pool takes its share of the card whatever the batch).
  On a CPU `sleep()` frees nothing and costs nothing, and null keeps calling it. Packs that skip the recompute
  (actor.gradient_checkpointing=null, memory_plan.recompute_above) take only the room left when the update
  starts (Trainable._recompute_limit), so an awake engine shortens them rather than the other way round.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from train.models.memory_plan import GIB, HEADROOM, free_device_bytes
from train.parallel.collectives import all_reduce_max, all_reduce_sum
from train.parallel.distributed import DistContext


@dataclass
class EngineSleep:
    """`rollout.sleep` (`asked`) and, for null, what says the next update's working bytes for a step batch of so
    many tokens over all ranks (`working`; None: the engine sleeps, for the reason `unestimated` gives, or on a
    CPU where that is free)."""
    asked: bool | None
    working: Callable[[int], int] | None
    ctx: DistContext
    free_bytes: Callable[[], int]  # this rank's free device bytes, now
    unestimated: str | None = None
    last: bool | None = None  # the decision of the step before (a line is logged when it changes)

    @classmethod
    def of(cls, asked: bool | None, ctx: DistContext, engine_kind: str, actor, critic) -> EngineSleep:
        """The policy of a run: `engine_kind` (rollout.engine, or "remote" for a dedicated rollout rank's, whose
        sleep is a no-op), the models that update (`update_working_bytes`): `actor`, and `critic` (None without
        one). With a critic the two updates' bytes are added (they run one after the other, so that is more than
        either needs)."""
        working, why = None, None
        if asked is None and ctx.device.type == "cuda" and engine_kind != "remote":  # (a rollout rank's never sleeps)
            trained = [m for m in (actor, critic) if m is not None]
            if engine_kind != "hf":
                why = f"the {engine_kind} engine keeps its KV pool otherwise"
            elif any(m.update_working_bytes() is None for m in trained):
                why = "no memory estimate for this run's update (Trainable.update_working_bytes)"
            else:
                working = lambda tokens: sum(m.update_working_bytes(tokens) for m in trained)  # noqa: E731
        return cls(asked, working, ctx, lambda: free_device_bytes(ctx.device), why)

    def decide(self, tokens: int) -> tuple[bool, str | None]:
        """Whether the engine sleeps through this update of a batch of which this rank holds `tokens`, and a
        line for the log when that changes (None otherwise; never on a CPU under null). Collective where null
        decides on a GPU (every rank calls it, in step order)."""
        if self.asked is not None:
            sleep, why = self.asked, f"rollout.sleep={str(self.asked).lower()}"
        elif self.working is None:
            sleep, why = True, self.unestimated and f"rollout.sleep=null: {self.unestimated}"
        else:
            total = int(all_reduce_sum([float(tokens)], self.ctx.device)[0])  # no pack is longer
            need = self.working(total) * HEADROOM
            free = self.free_bytes()
            # the rank with the least room decides for all (a max over ranks of its shortfall)
            short = all_reduce_max(max(need - free, 0.0), self.ctx.device)
            sleep = short > 0
            why = (f"rollout.sleep=null: the update of {total} tokens needs {need / GIB:.1f} GiB with 10% headroom "
                   f"(train/models/memory_plan.py), "
                   + (f"{short / GIB:.1f} GiB more than the tightest rank has free beside the engine" if sleep
                      else f"free beside the engine on every rank ({free / GIB:.1f} GiB on this one)"))
        changed, self.last = sleep != self.last, sleep
        if not changed or why is None:
            return sleep, None
        what = ("the engine sleeps during the update (its KV buffers, CUDA graphs and own weights freed)" if sleep
                else "the engine stays awake through the update (KV buffers, CUDA graphs and weights kept)")
        return sleep, f"{what}: {why}"
