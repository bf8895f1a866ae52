"""Tensor wire codec: torch tensors <-> streams of `TensorChunk` messages.

A tensor leaves as chunks of at most `CHUNK_BYTES`, so no gRPC message-size limit is ever
reached. Sending views the tensor's storage as bytes (no copy besides the one protobuf makes
per chunk); receiving writes the chunks into one preallocated buffer that `torch.frombuffer`
wraps without copying. The content key (BLAKE2b-128 over dtype, shape and bytes) is checked
on arrival, so a corrupted, truncated or mis-assembled stream is an error, never a tensor.

A first chunk's header is checked before its buffer is allocated: a known dtype, at most MAX_DIMS dimensions, none
negative, their product matching `nbytes`, and, where the receiver says what it expects (`Expected`), a tensor it
expects that fits in what the stream may still carry. A 60-byte header never allocates 2 GiB.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from h3serve.common.bounds import shown
from h3serve.common.streams import drain
from h3serve.v1 import tensor_pb2

CHUNK_BYTES = 1 << 20
MAX_DIMS = 8  # h3serve's tensors have at most 5

_TO_WIRE = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}


class WireError(ValueError):
    """A tensor stream that cannot be turned back into the tensor that was sent."""


@dataclass(frozen=True)
class Expected:
    """What a receiver takes: exactly the tensors `names`, `max_bytes` of them in all."""

    names: tuple[str, ...]
    max_bytes: int


def content_key(dtype: int, shape: Iterable[int], data) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype}:{','.join(map(str, shape))}:".encode())
    h.update(data)
    return h.hexdigest()


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")  # .data: the array's memoryview


def encode(name: str, tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> list[tensor_pb2.TensorChunk]:
    """Split `tensor` into chunks. Little-endian hosts only (x86-64, aarch64)."""
    if tensor.dtype not in _TO_WIRE:
        raise WireError(f"tensor {name!r}: dtype {tensor.dtype} has no wire form")
    dtype = _TO_WIRE[tensor.dtype]
    data = _as_bytes(tensor)
    head = tensor_pb2.Tensor(
        dtype=dtype, shape=list(tensor.shape), nbytes=data.nbytes, key=content_key(dtype, tensor.shape, data)
    )
    chunks = []
    for offset in range(0, max(data.nbytes, 1), chunk_bytes):
        piece = tensor_pb2.Tensor(data=bytes(data[offset : offset + chunk_bytes]))
        if offset == 0:
            piece.MergeFrom(head)
        chunks.append(tensor_pb2.TensorChunk(name=name, tensor=piece, offset=offset))
    return chunks


class TensorAssembler:
    """Collects chunks of any number of tensors, in stream order, and checks each one; with `expected`, only
    those tensors and at most that many bytes."""

    def __init__(self, expected: Expected | None = None) -> None:
        self._expected = expected
        self._allocated = 0
        self._done: dict[str, torch.Tensor] = {}
        self._name: str | None = None
        self._head: tensor_pb2.Tensor | None = None
        self._buf: bytearray | None = None
        self._filled = 0

    def add(self, chunk: tensor_pb2.TensorChunk) -> None:
        if chunk.offset == 0:
            self._finish_current()
            self._start(chunk)
        elif chunk.name != self._name:
            raise WireError(
                f"chunk of tensor {shown(chunk.name)} at offset {chunk.offset} arrived without its first chunk"
            )
        elif chunk.offset != self._filled:
            raise WireError(f"tensor {shown(chunk.name)}: chunk at offset {chunk.offset}, expected {self._filled}")
        buf = self._buf
        assert buf is not None  # the chunk continues the current tensor, or _start began it
        data = chunk.tensor.data
        if self._filled + len(data) > len(buf):
            raise WireError(f"tensor {shown(chunk.name)}: more bytes than the {len(buf)} announced")
        buf[self._filled : self._filled + len(data)] = data
        self._filled += len(data)

    def _start(self, chunk: tensor_pb2.TensorChunk) -> None:
        self._check_header(chunk.name, chunk.tensor)
        self._allocated += chunk.tensor.nbytes
        self._name, self._head = chunk.name, chunk.tensor
        self._buf, self._filled = bytearray(chunk.tensor.nbytes), 0

    def _check_header(self, name: str, head: tensor_pb2.Tensor) -> None:
        """Everything about a tensor that decides its buffer, before the buffer exists."""
        shown_name = shown(name)
        if self._expected is not None and name not in self._expected.names:
            raise WireError(f"unexpected tensor {shown_name}; send only {', '.join(self._expected.names)}")
        if name in self._done:
            raise WireError(f"tensor {shown_name} sent twice")
        if head.dtype not in _FROM_WIRE:
            raise WireError(f"tensor {shown_name}: unknown dtype {head.dtype}")
        shape = list(head.shape)
        if len(shape) > MAX_DIMS or any(dim < 0 for dim in shape):
            raise WireError(
                f"tensor {shown_name}: shape {shape[: MAX_DIMS + 1]}; at most {MAX_DIMS} dimensions, none negative"
            )
        needed = torch.empty(0, dtype=_FROM_WIRE[head.dtype]).element_size()
        for dim in shape:
            needed *= dim  # Python integers: no overflow to a small product
        if needed != head.nbytes:
            raise WireError(f"tensor {shown_name}: shape {shape} needs {needed} bytes, header says {head.nbytes}")
        if self._expected is not None and head.nbytes > self._expected.max_bytes - self._allocated:
            raise WireError(
                f"tensor {shown_name}: {head.nbytes} bytes, over the {self._expected.max_bytes} bytes a "
                f"request may carry here ({self._allocated} already announced)"
            )

    def _finish_current(self) -> None:
        if self._name is None:
            return
        name, head, buf = self._name, self._head, self._buf
        assert head is not None and buf is not None  # _start sets them with the name
        self._name = None
        if self._filled != len(buf):
            raise WireError(f"tensor {shown(name)} truncated: {self._filled} of {len(buf)} bytes arrived")
        if content_key(head.dtype, head.shape, buf) != head.key:
            raise WireError(f"tensor {shown(name)}: content key mismatch, the bytes were corrupted in transit")
        dtype = _FROM_WIRE[head.dtype]
        flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        self._done[name] = flat.reshape(tuple(head.shape))

    def finish(self, *required: str) -> dict[str, torch.Tensor]:
        """End of stream: check the last tensor and that every required name arrived."""
        self._finish_current()
        missing = [n for n in required if n not in self._done]
        if missing:
            raise WireError(f"stream ended without tensor(s) {', '.join(missing)}")
        return self._done


def decode(chunks: Iterable[tensor_pb2.TensorChunk], *required: str) -> dict[str, torch.Tensor]:
    assembler = TensorAssembler()
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish(*required)


@contextmanager
def refusal_heard(messages: Iterable) -> Iterator[None]:
    """Around reading a request stream: when the reader refuses it part-way (raises), the rest of the stream is
    read and dropped before the refusal goes on, so that the sender hears it (common/streams.py says why)."""
    try:
        yield
    except Exception:
        drain(messages)
        raise


def read_spec_stream(messages: Iterable, expect: Callable[[Any], Expected]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A request stream of one `spec` message, then tensor `chunk` messages (the DiT's and VAE's inputs).

    `expect(spec)` runs as soon as the spec arrives, before any chunk is read: it checks the spec (raising to
    refuse it) and says which tensors follow and how many bytes they may take. Returns the spec and exactly
    those tensors; anything else is a WireError.
    """
    spec: Any = None  # the stream's spec message: a DenoiseSpec, a DecodeSpec...
    assembler: TensorAssembler | None = None
    expected: Expected | None = None
    for message in messages:
        kind = message.WhichOneof("kind")
        if kind == "spec" and assembler is None:
            spec = message.spec
            expected = expect(spec)
            assembler = TensorAssembler(expected)
        elif kind == "chunk" and assembler is not None:
            assembler.add(message.chunk)
        else:
            raise WireError(f"unexpected {kind or 'empty'} message: send one spec, then the tensor chunks")
    if assembler is None or expected is None:
        raise WireError("stream ended without a spec")
    return spec, assembler.finish(*expected.names)


def encode_many(tensors: dict[str, torch.Tensor]) -> Iterator[tensor_pb2.TensorChunk]:
    for name, tensor in tensors.items():
        yield from encode(name, tensor)
