"""The Tinker REST API (`/api/v1/...`) over this project's trainer and `hf` engine; see docs/tinker.md.

`TinkerService` holds what rank 0 knows: the base models it serves, sessions, models and their request queues,
samplers, checkpoints (under `root/<model id>/`), and the futures. `build_app` maps the SDK's endpoints onto
it. Nothing a client sends reaches the model before it is checked: a bad request fails alone, with the SDK's
error (an HTTP status at submission, or a failed future naming the datum and field).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from train.tinker_service.futures import ModelQueue, QueueFull, RequestBook
from train.tinker_service.errors import ClientError
from train.tinker_service.ranks import RankGroup
from train.tinker_service.sampler import SamplerPool, Snapshot
from train.tinker_service.trainee import AdamStep, lora_of
from train.tinker_service.wire import decode_forward_backward, encode_forward_backward, encode_sample

PROTO = "application/x-protobuf"
USER_ERRORS = (ClientError, ValueError, KeyError)  # engine sampling checks raise ValueError; a missing JSON key


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ModelRecord:
    model_id: str
    base_model: str
    lora: dict | None
    queue: ModelQueue


class TinkerService:
    def __init__(self, bases: dict[str, str], ranks: RankGroup, root: str, *, api_key: str | None = None,
                 request_timeout_s: float = 600.0, queue_limit: int = 64, hold_s: float = 10.0,
                 device: torch.device | None = None, sample_gather_s: float = 0.01) -> None:
        self.bases, self.ranks, self.root, self.api_key = bases, ranks, root, api_key
        self.request_timeout_s, self.queue_limit, self.hold_s = request_timeout_s, queue_limit, hold_s
        self.book = RequestBook()
        self.sessions: set[str] = set()  # open sessions (ended by ServiceClient.close; they do not expire)
        self.models: dict[str, ModelRecord] = {}
        self.samplers: dict[str, Snapshot] = {}
        self.pool = SamplerPool(device or torch.device("cpu"), gather_s=sample_gather_s)
        os.makedirs(root, exist_ok=True)

    # ------------------------------------------------------------------ lookups

    def base_path(self, name: str | None) -> str:
        """A served base model's folder, by its name or by the folder itself (tinker-cookbook names a local
        model by its path, which its tokenizer loader then opens offline)."""
        if name and name not in self.bases and os.path.abspath(name) in self.bases.values():
            return os.path.abspath(name)
        if name not in self.bases:
            raise ApiError(404, f"unknown base model {name!r}; this service serves: {', '.join(self.bases)}")
        return self.bases[name]

    def record(self, model_id: str | None) -> ModelRecord:
        found = self.models.get(model_id or "")
        if found is None:
            raise ApiError(404, f"unknown model_id {model_id!r} (create it with create_lora_training_client, or "
                                "it was unloaded)")
        return found

    def folder(self, path: str, kind: str) -> str:
        """tinker://<model id>/<kind>/<name> as a folder under root, refusing anything that leaves it."""
        if not path.startswith("tinker://"):
            raise ApiError(400, f"path {path!r} is not a tinker:// path (tinker://<run id>/{kind}/<name>)")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] != kind or any(p in ("", ".", "..") for p in parts):
            raise ApiError(400, f"path {path!r} is not of the form tinker://<run id>/{kind}/<name>")
        return os.path.join(self.root, parts[0], kind, parts[2])

    # ------------------------------------------------------------------ training

    def submit(self, model_id: str, seq_id: int | None, work) -> dict:
        rec = self.record(model_id)
        rid = self.book.new()
        try:
            rec.queue.put(seq_id, rid, work, self.request_timeout_s)
        except QueueFull as e:
            raise ApiError(429, f"model {model_id}: {e}; retry later") from e
        return {"request_id": rid, "model_id": model_id}

    def run(self, name: str, **kwargs):
        return asyncio.wrap_future(self.ranks.submit(name, **kwargs))

    def new_model(self, model_id: str, base_model: str, lora: dict | None) -> ModelRecord:
        rec = ModelRecord(model_id, base_model, lora, ModelQueue(self.book, error_message, self.queue_limit))
        self.models[model_id] = rec
        os.makedirs(os.path.join(self.root, model_id), exist_ok=True)
        with open(os.path.join(self.root, model_id, "run.json"), "w") as f:
            json.dump({"base_model": base_model, "lora_config": lora}, f)
        return rec

    async def create_model(self, body: dict) -> dict:
        base_model = body.get("base_model")
        path = self.base_path(base_model)
        lora = body.get("lora_config")
        lora_of(lora)  # checked here, so a bad lora_config is a 400 at once
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise ApiError(400, f"optimizer_config.type={opt!r}: this service trains with adamw only")
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        rec = self.new_model(model_id, base_model, lora)
        seed = int((lora or {}).get("seed") or 0)

        async def work():
            await self.run("create", model_id=model_id, base_path=path, lora=lora, seed=seed)
            return {"model_id": model_id, "type": "create_model"}
        return self.submit(rec.model_id, 0, work)

    def forward_backward(self, body: bytes, forward_only_query: bool) -> dict:
        call = decode_forward_backward(body)
        rec = self.record(call.model_id)

        async def work():
            outputs, metrics = await self.run("forward_backward", model_id=rec.model_id, data=call.data,
                                              loss_fn=call.loss_fn, config=call.config,
                                              forward_only=call.forward_only or forward_only_query)
            return encode_forward_backward(outputs, metrics)
        return self.submit(rec.model_id, call.seq_id, work)

    def optim_step(self, body: dict) -> dict:
        params = body.get("adam_params") or body.get("optim_params")
        if params is None:
            raise ApiError(400, "optim_step: only Adam (adam_params) is supported by this service")
        step = AdamStep(**{k: float(v) for k, v in params.items() if k in AdamStep.__dataclass_fields__})
        model_id = body.get("model_id")

        async def work():
            metrics = await self.run("optim_step", model_id=model_id, step=step.__dict__)
            return {"metrics": metrics}
        return self.submit(model_id, body.get("seq_id"), work)

    def save_weights(self, body: dict) -> dict:
        model_id = body.get("model_id")
        name = body.get("path") or f"state-{int(time.time() * 1000)}"
        path = f"tinker://{model_id}/weights/{name}"
        folder = self.folder(path, "weights")

        async def work():
            await self.run("save", model_id=model_id, folder=folder)
            return {"path": path, "type": "save_weights"}
        return self.submit(model_id, body.get("seq_id"), work)

    async def load_weights(self, body: dict) -> dict:
        path = body["path"]
        folder = self.folder(path, "weights")
        if not os.path.isdir(folder):
            raise ApiError(404, f"no checkpoint at {path}")
        with_optimizer = bool(body.get("optimizer"))
        model_id, seq, create = body.get("model_id"), body.get("seq_id"), None
        if model_id is None:  # create_training_client_from_state: a new model from the checkpoint's run
            with open(os.path.join(os.path.dirname(os.path.dirname(folder)), "run.json")) as f:
                run = json.load(f)
            base_model = body.get("base_model") or run["base_model"]
            model_id, seq = f"{body['session_id']}:train:{body['model_seq_id']}", 0
            create = {"model_id": model_id, "base_path": self.base_path(base_model), "lora": run["lora_config"],
                      "seed": 0}
            self.new_model(model_id, base_model, run["lora_config"])

        async def work():
            if create is not None:
                await self.run("create", **create)
            await self.run("load", model_id=model_id, folder=folder, with_optimizer=with_optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}
        return self.submit(model_id, seq, work)

    def save_for_sampler(self, body: dict) -> dict:
        model_id = body.get("model_id")
        rec = self.record(model_id)
        name = body.get("path")
        base_path = self.base_path(rec.base_model)
        settings = lora_of(rec.lora)

        async def work():
            tensors = await self.run("sampler_weights", model_id=model_id)
            if name is None:  # save_weights_and_get_sampling_client: an ephemeral sampler
                sid = f"{model_id}:sample:{body.get('sampling_session_seq_id')}:{uuid.uuid4().hex[:8]}"
                self.samplers[sid] = Snapshot(sid, base_path, settings, tensors, rec.base_model)
                return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}
            path = f"tinker://{model_id}/sampler_weights/{name}"
            folder = self.folder(path, "sampler_weights")
            await asyncio.to_thread(_write_sampler, folder, tensors, rec)
            return {"path": path, "type": "save_weights_for_sampler"}
        return self.submit(model_id, body.get("seq_id"), work)

    def snapshot_at(self, path: str) -> Snapshot:
        folder = self.folder(path, "sampler_weights")
        if not os.path.isdir(folder):
            raise ApiError(404, f"no sampler weights at {path}")
        from safetensors.torch import load_file

        with open(os.path.join(folder, "meta.json")) as f:
            meta = json.load(f)
        settings = lora_of(meta["lora_config"])
        tensors = load_file(os.path.join(folder, "weights.safetensors"))
        return Snapshot(path, self.base_path(meta["base_model"]), settings, tensors, meta["base_model"])

    def snapshot_for(self, body: dict) -> Snapshot:
        """A request's weights: its `model_path`'s sampler weights, else its `base_model` itself."""
        if body.get("model_path"):
            return self.snapshot_at(body["model_path"])
        base = body.get("base_model")
        return Snapshot(f"base:{base}", self.base_path(base), base_model=base)

    # ------------------------------------------------------------------ sampling

    def create_sampling_session(self, body: dict) -> dict:
        snap = self.snapshot_for(body)
        sid = f"{body['session_id']}:sample:{body['sampling_session_seq_id']}"
        self.samplers[sid] = snap
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    def sample(self, body: dict) -> dict:
        sid = body.get("sampling_session_id")
        if sid is not None:
            snap = self.samplers.get(sid)
            if snap is None:
                raise ApiError(404, f"unknown sampling_session_id {sid!r}")
        else:
            snap = self.snapshot_for(body)
        prompt = [int(t) for c in body["prompt"]["chunks"] for t in _text_chunk(c)]
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise ApiError(400, f"{key} is not supported by this service (top-k log-probs)")
        if body.get("target_prompt_logprobs") is not None or body.get("record_stability_info"):
            raise ApiError(400, "target_prompt_logprobs and record_stability_info are not supported by this service")
        n = int(body.get("num_samples", 1))
        if n < 1 or not prompt:
            raise ApiError(400, "num_samples must be >= 1 and the prompt non-empty")
        rid = self.book.new()
        seq_ids = [f"{rid}:{i}" for i in range(n)]

        async def work():
            try:
                seqs, scored = await self.pool.sample(snap, prompt, n, body.get("sampling_params") or {},
                                                      bool(body.get("prompt_logprobs")),
                                                      body.get("prompt_logprobs_last_n"))
                self.book.finish(rid, encode_sample(seqs, scored))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                message, user = error_message(e)
                self.book.fail(rid, message, user)
        asyncio.get_running_loop().create_task(work())
        return {"request_id": rid, "sample_sequence_ids": seq_ids}

    # ------------------------------------------------------------------ misc

    def checkpoints(self, model_id: str) -> dict:
        out = []
        for kind, ctype in (("weights", "training"), ("sampler_weights", "sampler")):
            base = os.path.join(self.root, model_id, kind)
            for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
                if name.endswith(".tmp"):
                    continue
                full = os.path.join(base, name)
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(full) for f in fs)
                out.append({"checkpoint_id": f"{kind}/{name}", "checkpoint_type": ctype, "size_bytes": size,
                            "time": datetime.fromtimestamp(os.path.getmtime(full), timezone.utc).isoformat(),
                            "tinker_path": f"tinker://{model_id}/{kind}/{name}"})
        return {"checkpoints": out}

    def info(self, model_id: str) -> dict:
        rec = self.record(model_id)
        lora = rec.lora
        return {"type": "get_info", "model_id": model_id, "is_lora": lora is not None,
                "lora_rank": None if lora is None else int(lora["rank"]), "model_name": rec.base_model,
                "model_data": {"arch": "transformer", "model_name": rec.base_model,
                               "tokenizer_id": self.base_path(rec.base_model)}}


def _text_chunk(chunk: dict) -> list[int]:
    if chunk.get("type", "encoded_text") != "encoded_text":
        raise ApiError(400, f"prompt chunks of type {chunk.get('type')!r} are not supported (text models)")
    return chunk["tokens"]


def _write_sampler(folder: str, tensors: dict, rec: ModelRecord) -> None:
    from safetensors.torch import save_file

    tmp = folder + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "weights.safetensors"))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"base_model": rec.base_model, "lora_config": rec.lora}, f)
    if os.path.isdir(folder):
        import shutil

        shutil.rmtree(folder)
    os.replace(tmp, folder)


def error_message(e: BaseException) -> tuple[str, bool]:
    """(message, is the client's fault) for a request that failed."""
    user = isinstance(e, USER_ERRORS)
    return (str(e) if user else f"{type(e).__name__}: {e}"), user


def build_app(service: TinkerService) -> FastAPI:
    app = FastAPI(title="Infinite RL Tinker-compatible service")

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if service.api_key and request.url.path != "/api/v1/healthz":
            if request.headers.get("X-API-Key") != service.api_key:
                return JSONResponse({"detail": "invalid or missing API key (X-API-Key)"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.exception_handler(ValueError)  # ClientError among them
    @app.exception_handler(KeyError)
    async def bad_request(request: Request, e: Exception):
        # 400 is final for the SDK (no retry): the client's request is what is wrong.
        return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, status_code=400)

    def ok(value: Any) -> JSONResponse:
        return JSONResponse(value)

    @app.get("/api/v1/healthz")
    async def healthz():
        return ok({"status": "ok"})

    @app.post("/api/v1/client/config")
    async def client_config():
        # API-key auth, no JWT exchange; JSON everywhere except the two protobuf results; per-request polling.
        return ok({"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False,
                   "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                   "sample_join_sampling_session": False})

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return ok({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        models = [{"model_name": name, "trainable": True, "sampleable": True} for name in service.bases]
        return ok({"supported_models": models})

    @app.post("/api/v1/create_session")
    async def create_session():
        sid = f"session-{uuid.uuid4().hex[:12]}"
        service.sessions.add(sid)
        return ok({"type": "create_session", "session_id": sid})

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat():  # sessions do not expire here: nothing to renew
        return ok({"type": "session_heartbeat"})

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        # ServiceClient.close(): the session ends; its models and samplers stay until unloaded (a client may
        # resume from them), as its checkpoints do.
        service.sessions.discard(session_id)  # finishing twice, or after a restart, is not an error
        reason = ((await request.json()) or {}).get("reason", {})
        print(f"tinker service: session {session_id} finished ({reason.get('type', '?')})", flush=True)
        return Response(status_code=204)

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return ok({"status": "accepted"})

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        return ok(await service.create_model(await request.json()))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return ok(service.info((await request.json()).get("model_id")))

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request):
        model_id = (await request.json()).get("model_id")
        rec = service.record(model_id)

        async def work():
            await service.run("unload", model_id=model_id)
            service.models.pop(model_id, None)
            rec.queue.close()
            return {"model_id": model_id, "type": "unload_model"}
        return ok(service.submit(model_id, None, work))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return ok(service.forward_backward(await request.body(), False))

    @app.post("/api/v1/forward")
    async def forward(request: Request):
        return ok(service.forward_backward(await request.body(), True))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        return ok(service.optim_step(await request.json()))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        return ok(service.save_weights(await request.json()))

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        return ok(await service.load_weights(await request.json()))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        return ok(service.save_for_sampler(await request.json()))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        return ok(service.create_sampling_session(await request.json()))

    @app.get("/api/v1/samplers/{sampler_id:path}")
    async def sampler(sampler_id: str):
        snap = service.samplers.get(sampler_id)
        if snap is None:
            raise ApiError(404, f"unknown sampler {sampler_id!r}")
        base = snap.base_model or snap.base_path
        return ok({"sampler_id": sampler_id, "base_model": base,
                   "model_path": snap.snapshot_id if snap.snapshot_id.startswith("tinker://") else None})

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        return ok(service.sample(await request.json()))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        rid = (await request.json()).get("request_id")
        item = await service.book.poll(rid, service.hold_s)
        if item is None:
            raise ApiError(404, f"unknown request_id {rid!r} (finished more than an hour ago, or never sent)")
        if not item.done.is_set():
            return ok({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if isinstance(item.body, bytes):
            return Response(item.body, media_type=PROTO)
        return ok(item.body)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str):
        return ok(service.checkpoints(model_id))

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unsupported(rest: str):
        raise ApiError(404, f"/api/v1/{rest} is not implemented by this service (see docs/tinker.md for the "
                            "supported SDK methods)")

    return app
