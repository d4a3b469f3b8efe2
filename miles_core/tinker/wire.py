"""The Tinker SDK's protobuf messages on the service's side: requests in, results out.

The schema is the SDK's own (``tinker.proto.tinker_public_pb2``); the SDK's ``request_conv`` and
``response_conv`` are the encoders and decoders these mirror.

- ``parse_forward_backward(body, encoding)``: a ``ForwardBackwardRequest`` (the only protobuf
  request) as a ``ForwardBackward``: token arrays and loss inputs as numpy arrays.
- ``forward_backward_output(outputs, metrics)``: a ``ForwardBackwardOutput``, one ``ArrayRecord``
  whose fields hold every datum's array back to back (byte offsets per datum).
- ``sample_response(sequences, prompt_logprobs)``: a ``SampleResponse``.

Bad input raises ``WireError`` (a ``ValueError``) naming the datum and field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A request the service cannot read (the message says which part)."""


@dataclass
class Datum:
    tokens: np.ndarray
    """The model input's tokens (int64, ``[N]``): position i predicts ``target_tokens[i]``."""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """``loss_fn_inputs``: name -> array (``[N]`` per token, or the shape the client gave)."""


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def parse_forward_backward(body: bytes, encoding: str | None = None) -> ForwardBackward:
    """Read a ``ForwardBackwardRequest`` (zstd-compressed when ``encoding`` says so)."""
    if encoding and "zstd" in encoding:
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf: {e}") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins where both are written
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [_datum(d, i) for i, d in enumerate(msg.data)]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _datum(msg: pb.Datum, index: int) -> Datum:
    tokens = []
    for chunk in msg.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"datum {index}: a model input chunk of type {kind!r}; this service takes encoded "
                            "text only (no images or audio)")
        tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    inputs = {name: tensor(t, f"datum {index}, loss_fn_inputs[{name!r}]") for name, t in msg.loss_fn_inputs.items()}
    joined = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, dtype=np.int64)
    return Datum(joined, inputs)


def tensor(msg: pb.Tensor, where: str) -> np.ndarray:
    """A ``Tensor`` message as a numpy array of its shape (a sparse CSR one made dense)."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported dtype {pb.DType.Name(msg.dtype)}")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise WireError(f"{where}: a sparse CSR tensor needs a 2-d shape, got {shape}")
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        cols = np.frombuffer(csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtype)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, cols] = values
        return dense
    flat = np.frombuffer(msg.dense, dtype=dtype)
    if not shape:
        return flat.copy()
    if int(np.prod(shape)) != flat.size:
        raise WireError(f"{where}: shape {shape} does not hold its {flat.size} values")
    return flat.reshape(shape).copy()


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ``ForwardBackwardOutput``: each datum's float32 arrays (``logprobs``, ...) and the metrics,
    whose keys must read ``name:reduction`` (the SDK sums or averages them over chunks by that)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"metric {key!r}: the SDK needs 'name:reduction' keys")
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.ascontiguousarray(o[name], dtype=np.float32) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        field_ = record.fields[name]
        field_.data = b"".join(a.tobytes() for a in arrays)
        field_.offsets = offsets.tobytes()
        field_.dtype = pb.DTYPE_FLOAT32
        field_.trailing_shape.extend(arrays[0].shape[1:])
    return msg.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: list[float] | None = None) -> bytes:
    """A ``SampleResponse``: per sequence (tokens, their logprobs, ``"stop"`` | ``"length"``);
    ``prompt_logprobs`` has one value per prompt token, NaN where none is defined (the first)."""
    msg = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
