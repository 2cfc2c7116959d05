"""Multi-turn rollout: one coroutine per sample, all in flight together.

engine.generate (token ids in, token ids + log-probs out) -> env.interact may add tool messages ->
their template tokens are appended (action_mask 0) -> again, up to max_turns -> env.reward scores
the sample the moment it finishes, while other samples are still generating.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from train.datasets.tokenize import bound_messages, continuation_ids, prompt_ids, prompt_too_long
from train.datasets.vision import ImageError, ImageInputs, VisionProcessor, has_images
from train.engines.base import RolloutEngine, SamplingParams
from train.workers.env_routing import EnvRouter
from train.workers.environment import EnvCallError, Environment


@dataclass
class Sample:
    group: int  # index of the prompt within this rank's batch; samples of a group are contiguous
    messages: list[dict]
    answer: Any
    ids: list[int]  # prompt + every turn, exactly as sampled / templated
    action_mask: list[int]  # 1 on tokens the policy sampled (end-of-turn included)
    sampler_logprobs: list[float]  # engine log-prob per token (0.0 where action_mask is 0)
    reward: float = 0.0
    finish_reason: str = "stop"
    n_turns: int = 0
    env_error: str | None = None
    events: list[dict] = field(default_factory=list)
    prompt_length: int = 0  # templated prompt tokens
    turn_lengths: list[int] = field(default_factory=list)  # tokens sampled in each assistant turn
    turn_versions: list[int] = field(default_factory=list)  # the engine's weight version of each turn's first token
    # The weight version that sampled each token of `ids` (-1 where nothing was sampled: prompt, env tokens). With
    # rollout.inflight a turn may span versions: each token's sampler log-prob is its own version's.
    token_versions: list[int] = field(default_factory=list)
    source: str | None = None  # the row's data source (mixtures): its environment and metrics
    # Set by the trainer before filtering (train/trainer/step.py::shape_rewards): the reward the advantages
    # use (with DAPO's overlong penalty), and that penalty.
    shaped_reward: float | None = None
    overlong_penalty: float = 0.0
    # The experts each position was routed to when the engine ran it ([positions, layers, top_k], a prefix
    # of ids; engines that record them: actor.router_replay, train/models/router_replay.py); None otherwise.
    routing: torch.Tensor | None = None
    # The images of the conversation (a vision-language policy: the row's, then those of tool replies), in the
    # order of their placeholder runs in `ids` (train/datasets/vision.py); empty for text.
    images: list[ImageInputs] = field(default_factory=list)
    uid: int | None = None  # its group's admission number (rollout.inflight; trajectories.jsonl)
    criteria: dict[str, float] = field(default_factory=dict)  # a rubric reward's per-criterion scores (rubric.py)

    @property
    def n_action_tokens(self) -> int:
        return sum(self.action_mask)

    def oldest_version(self) -> int | None:
        """The version of its oldest sampled token (None: nothing sampled yet)."""
        versions = [v for v in self.token_versions if v >= 0] or self.turn_versions
        return min(versions) if versions else None


@dataclass
class Partial:
    """A sample that may stop between two of its tokens and go on later (rollout.inflight): the sample so far,
    the conversation as the env sees it, and where its turns stand. Everything here pickles: a checkpoint keeps it,
    a rollout rank receives and returns it. The env modules are functions of the conversation (`interact`,
    `reward_fn`), so `messages` is the env's whole state."""
    sample: Sample
    row: dict  # the training row (its environment, answer and tools)
    seed: int  # the sample's request seed; turn t draws from seed + t
    # the conversation as the template renders it (images as placeholders); None: `messages` itself
    shown: list[dict] | None = None
    turn: int = 0  # turns finished
    turn_tokens: int = 0  # tokens sampled so far in the turn in progress
    generated: bool = False  # its last turn is over (its reward may still be computing)
    done: bool = False  # generated and scored
    over_stale: bool = False  # older than rollout.max_staleness allows, trained anyway (rollout.over_stale=finish)
    awaiting_env: bool = False  # its turn is over and the env's reply to it not yet taken

    @property
    def messages(self) -> list[dict]:
        return self.sample.messages


@dataclass
class Group:
    """A prompt's samples in flight together (rollout.inflight): admitted once, trained whole when every sample is
    done. `uid` orders groups (admission order) and names them in logs; `seeds` are one per sample (a requeued
    sample draws a new one)."""
    uid: int
    row: dict
    row_index: int  # the row's index in the training data (curriculum statistics)
    seeds: list[int]
    # None until its first segment templates the prompt and starts them; a None member: a sample to start again
    # (rollout.over_stale=requeue), with its new seed
    members: list[Partial | None] | None = None

    @property
    def generated(self) -> bool:
        """Every sample's last turn is over (rewards may still be computing): the group may be trained."""
        return self.members is not None and all(p is not None and p.generated for p in self.members)

    @property
    def done(self) -> bool:
        return self.members is not None and all(p is not None and p.done for p in self.members)


def record_routing(sample: Sample, routing: torch.Tensor | None) -> None:
    """Extend the sample's routing with a turn's: each position keeps the routing of the turn that ran
    it first (its sampled tokens from that turn's decoding; the environment's tokens from the next
    turn's prefill), the routing its sampler log-probs were computed under."""
    if routing is None:
        return
    have = 0 if sample.routing is None else sample.routing.shape[0]
    new = routing[have:]
    sample.routing = new if sample.routing is None else torch.cat([sample.routing, new])


def sample_seed(base_seed: int, step: int, index: int) -> int:
    """A request seed that depends only on (run seed, step, global sample index)."""
    return (base_seed * 1_000_003 + step * 100_003 + index * 7919) % (2**31 - 1)


# rollout.max_env_chars=null: characters of env messages kept per token of context left. Tokenizers
# average 3-5 characters per token on text and code; a reply averaging more than 16 would rarely
# have fitted whole anyway, and a 1 MB reply no longer costs seconds of tokenization per turn.
ENV_CHARS_PER_TOKEN = 16

# The finish reason of a sample whose row's prompt fills the context: nothing sampled, nothing trained.
PROMPT_TOO_LONG = "prompt_too_long"
# ... whose row's prompt holds an image that cannot be used (a missing file, bytes that are no image, too many
# pixels; its event names the row and the image): nothing sampled, nothing trained.
BAD_IMAGE = "bad_image"
UNUSABLE_PROMPTS = (PROMPT_TOO_LONG, BAD_IMAGE)


class RolloutWorker:
    def __init__(self, engine: RolloutEngine, env: Environment | EnvRouter, tokenizer, *, max_turns: int,
                 env_error_reward: float, max_total_length: int, max_env_chars: int | None = None,
                 vision: VisionProcessor | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        # A vision-language policy's image processing (None: a text model; a conversation with images is
        # then an error naming the row or the env reply).
        self.vision = vision
        self.envs = EnvRouter.of(env)  # each row's environment (rollout.env_path may map sources to files)
        self.max_turns = max_turns
        self.env_error_reward = env_error_reward
        self.max_total_length = max_total_length
        self.max_env_chars = max_env_chars  # rollout.max_env_chars (None: ENV_CHARS_PER_TOKEN per token left)
        # One loop for the worker's life: the engine's batching task and env clients bind to it.
        self.loop = asyncio.new_event_loop()
        # Rewards of in-flight samples still computing after their segment ended, and env calls of continuous
        # segments still running, by (group uid, sample index).
        self._scoring: dict[tuple[int, int], asyncio.Future] = {}
        self._env_calls: dict[tuple[int, int], asyncio.Future] = {}

    def _prompt(self, row: dict) -> tuple[list[int], list[dict], list[ImageInputs]] | ImageError:
        """The row's prompt ids, its messages as the template renders them (images as placeholder text),
        and its processed images; or the ImageError of an image that cannot be used."""
        where = getattr(row, "where", None) or "a row"
        try:
            if self.vision is not None:
                shown, images = self.vision.prepare(row["messages"], where)
            elif has_images(row["messages"]):
                raise ImageError(f"{where} holds an image and the model is text-only: train a vision-language "
                                 "model (docs/vision.md)")
            else:
                shown, images = row["messages"], []
        except ImageError as e:
            return e
        return prompt_ids(self.tokenizer, shown, row.get("tools")), [dict(m) for m in shown], images

    def start(self, row: dict, prompt: tuple[list[int], list[dict], list[ImageInputs]] | ImageError, group: int,
              seed: int) -> Partial:
        """A sample of `row` before its first token; one whose prompt cannot be used is done at once (the
        trainer drops its group and reports the row)."""
        messages = [dict(m) for m in row["messages"]]
        source = row.get("source")
        source = None if source is None else str(source)
        if isinstance(prompt, ImageError):
            event = {"type": BAD_IMAGE, "row": getattr(row, "where", None), "error": str(prompt)}
            return Partial(Sample(group, messages, row.get("answer"), [], [], [], finish_reason=BAD_IMAGE,
                                  source=source, events=[event]),
                           row, seed, generated=True, done=True)
        ids, shown, images = prompt
        if prompt_too_long(len(ids), self.max_total_length):
            # No room for one sampled token: nothing to generate, score or train. The trainer drops
            # the group and warns, naming the row (data.overlong_prompts).
            return Partial(Sample(group, messages, row.get("answer"), [], [], [], finish_reason=PROMPT_TOO_LONG,
                                  prompt_length=len(ids), source=source,
                                  events=[{"type": PROMPT_TOO_LONG, "row": getattr(row, "where", None),
                                           "tokens": len(ids), "limit": self.max_total_length}]),
                           row, seed, generated=True, done=True)
        sample = Sample(group, messages, row.get("answer"), list(ids), [0] * len(ids), [0.0] * len(ids),
                        prompt_length=len(ids), source=source, images=list(images), token_versions=[-1] * len(ids))
        return Partial(sample, row, seed, shown=shown if self.vision is not None else None)

    async def _advance(self, p: Partial, sampling: SamplingParams, budget: int | None,
                       generated: Callable[[], None]) -> None:
        """Take `p` on until it is done (generated, then scored) or has sampled `budget` more tokens (None: no
        limit); `generated()` is called once, when this call will not use the engine again (before the reward,
        which may still take long: a judge, a sandbox)."""
        try:
            if not p.generated:
                await self._generate(p, sampling, budget)
        finally:
            generated()
        if p.generated and not p.done:
            await self._score(p)

    async def _generate(self, p: Partial, sampling: SamplingParams, budget: int | None,
                        env_key: tuple[int, int] | None = None) -> None:
        """The sample's turns from where they stand, until its last turn is over (`p.generated`) or it pauses
        (`budget` more tokens sampled, or with `env_key` an env call started). An env call that fails
        scores it rollout.env_error_reward and ends it."""
        try:
            finished = await self._turns(p, self.envs.for_row(p.row), sampling, budget, env_key)
        except EnvCallError as e:
            p.sample.reward, p.sample.env_error = self.env_error_reward, str(e)
            p.generated, p.done, p.awaiting_env = True, True, False
            return
        p.generated = finished

    async def _turns(self, p: Partial, env: Environment, sampling: SamplingParams, budget: int | None,
                     env_key: tuple[int, int] | None = None) -> bool:
        """Generate, let the env answer, again, up to max_turns, from where `p` stands; the sample and its
        conversation grow in place. False when it paused: `budget` sampled tokens ran out first (the turn in
        progress goes on in the next call: seeded requests continue their stream of uniforms where they stopped),
        or, with `env_key` (continuous segments), an env call started: it runs on past this call (the next one
        takes its reply), so no segment waits for a tool. `p.shown` is the conversation as the template renders it
        (with images: their placeholder text), which the env never sees."""
        tok, sample, messages = self.tokenizer, p.sample, p.messages
        used = 0
        while True:
            if p.awaiting_env:  # the reply of the env call an earlier segment started (or, after a resume, anew)
                task = self._env_calls.pop(env_key, None) if env_key is not None else None
                new = await (task if task is not None else env.interact(messages))
                p.awaiting_env = False
                if not self._take_reply(p, new):
                    return True
            if p.turn >= self.max_turns:
                return True
            turn = p.turn
            room = self.max_total_length - len(sample.ids)
            if room <= 0:
                sample.finish_reason = "length"
                return True
            allowed = min(sampling.max_new_tokens - p.turn_tokens, room)
            if budget is not None:
                if used >= budget:
                    return False
                allowed = min(allowed, budget - used)
            limit_is_budget = budget is not None and allowed < min(sampling.max_new_tokens - p.turn_tokens, room)
            params = replace(sampling, seed=p.seed + turn, seed_offset=p.turn_tokens, max_new_tokens=allowed)
            version = getattr(self.engine, "weight_version", 0)  # engines that cannot tag their outputs
            gen = await (self.engine.generate(sample.ids, params, images=sample.images) if sample.images
                         else self.engine.generate(sample.ids, params))
            version = int(gen.extra.get("weight_version", version))
            if p.turn_tokens == 0:
                sample.turn_versions.append(version)
                sample.turn_lengths.append(0)
            record_routing(sample, gen.extra.get("routing"))
            sample.ids += gen.token_ids
            sample.action_mask += [1] * len(gen.token_ids)
            sample.sampler_logprobs += list(gen.logprobs)
            sample.token_versions += [version] * len(gen.token_ids)
            sample.turn_lengths[-1] += len(gen.token_ids)
            p.turn_tokens += len(gen.token_ids)
            used += len(gen.token_ids)
            sample.finish_reason = gen.finish_reason
            sample.n_turns = turn + 1
            if limit_is_budget and gen.finish_reason == "length" and len(gen.token_ids) == allowed:
                return False  # the segment's budget, not the turn's: paused mid-turn
            turn_ids = sample.ids[len(sample.ids) - p.turn_tokens:]
            p.turn, p.turn_tokens = turn + 1, 0
            ended_with_eos = bool(turn_ids) and turn_ids[-1] == tok.eos_token_id
            text_ids = turn_ids[:-1] if ended_with_eos else turn_ids
            messages.append({"role": "assistant", "content": tok.decode(text_ids, skip_special_tokens=True)})
            if p.shown is not None:
                p.shown.append(messages[-1])
            if gen.finish_reason != "stop" or turn == self.max_turns - 1:
                return True
            p.awaiting_env = True
            if env_key is not None:
                self._env_calls[env_key] = asyncio.ensure_future(env.interact(list(messages)))
                await asyncio.sleep(0)  # (its call starts now)
                return False

    async def _score(self, p: Partial) -> tuple[float, str | None]:
        """The generated sample's reward (an env error scores it rollout.env_error_reward); (reward, error)."""
        try:
            p.sample.reward = await self.envs.for_row(p.row).reward(p.messages, p.sample.answer)
            p.sample.criteria = dict(getattr(p.sample.reward, "criteria", {}))
            for name, error in getattr(p.sample.reward, "errors", {}).items():  # the criterion scored 0
                p.sample.events += [{"type": "rubric_error", "criterion": name, "error": error}]
            p.sample.reward = float(p.sample.reward)
        except EnvCallError as e:
            p.sample.reward, p.sample.env_error = self.env_error_reward, str(e)
        p.done = True
        return p.sample.reward, p.sample.env_error

    def _take_reply(self, p: Partial, new: list[dict]) -> bool:
        """The env's reply to turn `p.turn - 1` into the sample (bounded, templated, its images processed); False
        when the episode ends instead: no reply, or one that does not fit the context."""
        tok, sample, messages = self.tokenizer, p.sample, p.messages
        shown = p.shown if p.shown is not None else messages
        turn = p.turn - 1
        if not new:
            return False
        # Bounded in characters before tokenization (a 1 MB reply would take seconds of BPE to
        # find it does not fit); what is kept still has to fit the context below.
        new, chars, kept = bound_messages(new, self.env_char_budget(self.max_total_length - len(sample.ids)))
        if kept < chars:
            sample.events += [{"type": "env_truncated", "turn": turn, "chars": chars, "kept": kept}]
        new_shown, new_images = self._shown(new, turn)
        ended_with_eos = sample.ids[-1] == tok.eos_token_id  # (the turn's last token: it just ended)
        extra = continuation_ids(tok, shown, new_shown, p.row.get("tools"), ended_with_eos=ended_with_eos)
        if len(sample.ids) + len(extra) >= self.max_total_length:
            # The env's messages do not fit the context (with room for one more token): the
            # episode ends here and is scored without them, never holding more than the context.
            sample.finish_reason = "context"
            sample.events += [{"type": "context_overflow", "turn": turn, "env_tokens": len(extra),
                               "room": self.max_total_length - len(sample.ids)}]
            return False
        sample.events += [{"type": "tool", "turn": turn, "messages": new}]
        messages += new
        if shown is not messages:
            shown += new_shown
            sample.images += new_images
        sample.ids += extra
        sample.action_mask += [0] * len(extra)
        sample.sampler_logprobs += [0.0] * len(extra)
        sample.token_versions += [-1] * len(extra)
        return True

    def _shown(self, new: list[dict], turn: int) -> tuple[list[dict], list[ImageInputs]]:
        """The env's messages as the template renders them, and their images. An image that cannot be used
        is the env's error (EnvCallError: the sample is scored rollout.env_error_reward and the run goes on)."""
        try:
            if self.vision is not None:
                return self.vision.prepare(new, f"the env's reply in turn {turn}")
            if has_images(new):
                raise ImageError(f"the env's reply in turn {turn} holds an image and the model is text-only")
        except ImageError as e:
            raise EnvCallError("interact", "bad image", str(e)) from None
        return new, []

    def env_char_budget(self, room: int) -> int:
        """Characters of env messages kept in a turn with `room` tokens of context left."""
        derived = max(room, 0) * ENV_CHARS_PER_TOKEN
        return derived if self.max_env_chars is None else min(self.max_env_chars, derived)

    async def _run_all(self, rows: list[dict], n: int, sampling: SamplingParams, base_seed: int,
                       generated: Callable[[], None]) -> list[Sample]:
        # The prompt is templated (and its images processed) once per row, not once per sample.
        prompts = [self._prompt(row) for row in rows]
        partials = [self.start(row, prompts[g], g, base_seed + (g * n + k) * 7919) for g, row in enumerate(rows)
                    for k in range(n)]
        await asyncio.gather(*(self._advance(p, sampling, None, generated) for p in partials))
        return [p.sample for p in partials]

    def rollout(self, rows: list[dict], responses_per_prompt: int, sampling: SamplingParams,
                base_seed: int, what: str = "a rollout", on_generated: Callable[[], None] | None = None,
                ) -> tuple[list[Sample], float]:
        """All samples of `rows` (each repeated `responses_per_prompt` times, contiguous) and the
        wall time. Order is deterministic whatever order the samples finish in. `on_generated()` is
        called (from this thread) once no sample will use the engine again, while rewards may still
        be computing: a weight push may go ahead from then on. (`what` names the request where it
        crosses ranks: train/workers/remote_rollout.py.)"""
        (samples,), seconds = self.rollout_many([(rows, responses_per_prompt, sampling, base_seed)], on_generated)
        return samples, seconds

    def rollout_many(self, requests: list[tuple[list[dict], int, SamplingParams, int]],
                     on_generated: Callable[[], None] | None = None) -> tuple[list[list[Sample]], float]:
        """Several `rollout` requests in flight together (one engine batch across them: a rollout
        rank serving several trainer ranks); each one's samples, and the wall time of all."""
        start = time.perf_counter()
        generating = [sum(len(rows) * n for rows, n, _, _ in requests)]

        def generated() -> None:
            generating[0] -= 1
            if generating[0] == 0 and on_generated is not None:
                on_generated()

        if generating[0] == 0 and on_generated is not None:
            on_generated()

        async def run_all() -> list[list[Sample]]:
            return list(await asyncio.gather(*(self._run_all(*request, generated) for request in requests)))

        return self.loop.run_until_complete(run_all()), time.perf_counter() - start

    def advance(self, groups: list[Group], sampling: SamplingParams, budget: int, what: str = "a segment",
                on_generated: Callable[[], None] | None = None, defer_env: bool = False,
                ) -> tuple[list[Group], float]:
        """One segment (rollout.inflight): every sample of `groups` not generated yet goes on until its last turn is
        over or it has sampled `budget` more tokens; samples not started (a new group, a requeued sample) are
        templated and started first, seeded by `group.seeds`. Returns once no sample uses the engine (the groups,
        changed in place, and the wall time): the reward of each sample generated meanwhile started the moment it
        was and runs on (`scores` collects it; rewards in by then are on their samples already). `defer_env`
        (continuous segments): a sample pauses at each env call, which runs on past the segment; a segment with
        nothing to generate waits for the first env reply or reward to come in. `on_generated`: called once no
        sample uses the engine; `what` names the request where it crosses ranks."""
        start = time.perf_counter()
        for i, group in enumerate(groups):
            if group.members is None:
                group.members = [None] * len(group.seeds)
            if any(p is None for p in group.members):
                prompt = self._prompt(group.row)
                group.members = [self.start(group.row, prompt, i, seed) if p is None else p
                                 for p, seed in zip(group.members, group.seeds)]

        async def one(key: tuple[int, int], p: Partial) -> None:
            await self._generate(p, sampling, budget, key if defer_env else None)
            if p.generated and not p.done:  # scored from now on, past this segment's end
                self._scoring[key] = asyncio.ensure_future(self._score(p))
                await asyncio.sleep(0)  # (its env call starts now, not at the loop's next run)

        def replied(key: tuple[int, int], p: Partial) -> bool:  # its env reply is in (or must be asked again)
            task = self._env_calls.get(key)
            return not p.awaiting_env or not defer_env or task is None or task.done()

        members = [((g.uid, j), p) for g in groups for j, p in enumerate(g.members) if not p.generated]
        runnable = [(key, p) for key, p in members if replied(key, p)]
        if defer_env and not runnable:  # only env calls and rewards running: wait for the first to come in
            pending = [self._env_calls[key] for key, p in members if key in self._env_calls]
            pending += [task for task in self._scoring.values() if not task.done()]
            if pending:
                self.loop.run_until_complete(_first_of(pending))
            runnable = [(key, p) for key, p in members if replied(key, p)]
        if runnable:
            self.loop.run_until_complete(_gather([one(key, p) for key, p in runnable]))
        for g in groups:  # rewards that came in meanwhile (on a rollout rank: onto the copies that go back)
            for j, p in enumerate(g.members):
                task = self._scoring.get((g.uid, j))
                if p.generated and not p.done and task is not None and task.done():
                    p.sample.reward, p.sample.env_error = self._scoring.pop((g.uid, j)).result()
                    p.done = True
        if on_generated is not None:
            on_generated()
        return groups, time.perf_counter() - start

    def finished_scores(self) -> dict[tuple[int, int], tuple[float, str | None]]:
        """The (reward, env error) of every sample whose reward came in since it was generated (each handed out
        once): a rollout rank sends them with each segment's groups, so generated groups need not travel again."""
        done = [key for key, task in self._scoring.items() if task.done()]
        return {key: self._scoring.pop(key).result() for key in done}

    def scores(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, str | None]]:
        """The (reward, env error) of the samples `keys` ((group uid, sample index)) generated by earlier segments,
        waiting for the reward calls still running (each bounded by rollout.env_timeout_s)."""
        tasks = {key: self._scoring.pop(key) for key in keys if key in self._scoring}
        if tasks:
            self.loop.run_until_complete(_gather(list(tasks.values())))
        return {key: task.result() for key, task in tasks.items()}

    def pop_api_calls(self) -> list[dict]:
        """External calls the environments made since the last pop (latency statistics)."""
        return self.envs.pop_api_calls()

    @property
    def stuck_calls(self) -> int:
        """Sync env calls still running past their timeout, each holding a thread."""
        return self.envs.stuck_calls

    def close(self) -> None:
        # Background tasks (the engine's batcher) end with the loop, not after it.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()
        self.envs.close()
        self.engine.close()


async def _gather(awaitables: list) -> list:
    """asyncio.gather on the loop running it (gathered from outside, futures would look for another loop)."""
    return list(await asyncio.gather(*awaitables))


async def _first_of(futures: list) -> None:
    """Until the first of `futures` is done."""
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
