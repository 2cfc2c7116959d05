"""The Tinker wire formats this service reads and writes.

`forward_backward` requests and the `ForwardBackwardOutput` / `SampleResponse` results travel as protobuf
(the SDK asks for them with `Accept: application/x-protobuf` and refuses JSON for these two types); every
other request and result is JSON. The message schema is the SDK's own (`tinker.proto.tinker_public_pb2`,
the protocol's definition, like an OpenAPI file); the decoding and encoding here are this project's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tinker.proto import tinker_public_pb2 as pb

from train.tinker_service.errors import ClientError

_NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    tokens: list[int]  # model_input's tokens, chunks concatenated
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # loss_fn_inputs, dense


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _dense(msg: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise ClientError(f"{where}: unsupported tensor dtype {msg.dtype}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) == 1:  # a 1-D tensor's CSR is one row
            shape = [1, shape[0]]
            squeeze = True
        else:
            squeeze = False
        if len(shape) != 2 or len(crow) != shape[0] + 1:
            raise ClientError(f"{where}: sparse tensor of shape {list(msg.shape)} has {len(crow)} row pointers")
        out = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            out[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return out[0] if squeeze else out
    values = np.frombuffer(msg.dense, dtype=dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise ClientError(f"{where}: shape {shape} holds {int(np.prod(shape))} values, the data has {values.size}")
    return values.reshape(shape) if shape else values


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ClientError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from e
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ClientError(f"data[{i}].model_input: {kind} chunks are not supported by this service "
                                "(text models; send encoded_text)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _dense(t, f"data[{i}].loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    flat = [np.ascontiguousarray(a, dtype=_NUMPY[dtype]).reshape(-1) for a in arrays]
    sizes = np.array([0] + [a.nbytes for a in flat], dtype=np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in flat), offsets=np.cumsum(sizes).tobytes(),
                            dtype=dtype)


def encode_forward_backward(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum float32 outputs (each [N]) and the scalar metrics, as a ForwardBackwardOutput."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    if outputs:
        record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            record.fields[name].CopyFrom(_batched([o[name] for o in outputs], pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # True: a stop token/string or EOS ended it; False: max_tokens did


def encode_sample(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A SampleResponse; `prompt_logprobs[0]` (and any unscored position) is NaN, which the SDK reads as None."""
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                          logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
