"""The tensor wire codec: exact round trips, any size through real gRPC, clear errors on bad streams."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from h3serve.runtime import wire
from h3serve.v1 import tensor_pb2

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact(dtype):
    source = (torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 1000).to(dtype)
    chunks = wire.encode("x", source, chunk_bytes=64)
    assert len(chunks) > 1
    out = wire.decode(chunks, "x")["x"]
    assert out.dtype == dtype and out.shape == source.shape
    assert torch.equal(
        out.view(torch.uint8) if dtype == torch.bool else out,
        source.view(torch.uint8) if dtype == torch.bool else source,
    )


def test_special_values_and_shapes_survive():
    source = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45], dtype=torch.float32)
    out = wire.decode(wire.encode("s", source), "s")["s"]
    assert out.view(torch.int32).tolist() == source.view(torch.int32).tolist()  # bit patterns, NaN included
    assert wire.decode(wire.encode("e", torch.empty(0, 4)), "e")["e"].shape == (0, 4)
    assert wire.decode(wire.encode("z", torch.tensor(3.5)), "z")["z"].item() == 3.5


def _echo_server():
    """A real loopback gRPC server with default message limits that streams back what it gets."""

    def echo(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Echo": grpc.stream_stream_rpc_method_handler(
                echo,
                request_deserializer=tensor_pb2.TensorChunk.FromString,
                response_serializer=tensor_pb2.TensorChunk.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_tensor_over_grpc_default_limit_crosses_real_grpc():
    source = torch.randn(3, 1024, 1024, dtype=torch.float32)  # 12 MiB, 3x the 4 MiB default limit
    server, port = _echo_server()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.stream_stream(
                "/test.Echo/Echo",
                request_serializer=tensor_pb2.TensorChunk.SerializeToString,
                response_deserializer=tensor_pb2.TensorChunk.FromString,
            )
            out = wire.decode(echo(iter(wire.encode("big", source))), "big")["big"]
    finally:
        server.stop(None)
    assert torch.equal(out, source)


def test_corrupted_chunk_is_refused():
    chunks = wire.encode("x", torch.arange(1000, dtype=torch.int64), chunk_bytes=1024)
    data = bytearray(chunks[2].tensor.data)
    data[5] ^= 0xFF
    chunks[2].tensor.data = bytes(data)
    with pytest.raises(wire.WireError, match="content key mismatch"):
        wire.decode(chunks, "x")


def test_truncated_stream_is_refused():
    chunks = wire.encode("x", torch.arange(1000, dtype=torch.int64), chunk_bytes=1024)
    with pytest.raises(wire.WireError, match="truncated: 7168 of 8000 bytes"):
        wire.decode(chunks[:-1], "x")


def test_missing_gap_and_missing_tensor_are_refused():
    chunks = wire.encode("x", torch.arange(1000, dtype=torch.int64), chunk_bytes=1024)
    with pytest.raises(wire.WireError, match="offset 2048, expected 1024"):
        wire.decode([chunks[0], *chunks[2:]], "x")
    with pytest.raises(wire.WireError, match="without its first chunk"):
        wire.decode(chunks[1:], "x")
    with pytest.raises(wire.WireError, match="without tensor"):
        wire.decode(chunks, "x", "y")


def test_header_that_lies_about_size_is_refused():
    chunks = wire.encode("x", torch.zeros(4, dtype=torch.float32))
    chunks[0].tensor.nbytes = 12
    with pytest.raises(wire.WireError, match="needs 16 bytes"):
        wire.decode(chunks, "x")


def _header(name: str, dtype: int, shape: list[int], nbytes: int) -> tensor_pb2.TensorChunk:
    """The first chunk of a tensor as a client may send it: a header and no bytes yet."""
    return tensor_pb2.TensorChunk(name=name, tensor=tensor_pb2.Tensor(dtype=dtype, shape=shape, nbytes=nbytes))


F32 = tensor_pb2.DTYPE_FLOAT32


@pytest.mark.parametrize(
    "shape,nbytes,message",
    [
        ([-1, -1], 4, r"shape \[-1, -1\]; at most 8 dimensions, none negative"),
        ([1] * 9, 4, "at most 8 dimensions"),
        ([2**62, 2], 2**63, r"needs 36893488147419103232 bytes, header says 9223372036854775808"),  # no wrap-around
        ([2**30], 4, "needs 4294967296 bytes, header says 4"),
    ],
)
def test_a_header_that_cannot_describe_its_bytes_is_refused_before_allocating(shape, nbytes, message):
    with pytest.raises(wire.WireError, match=message):
        wire.TensorAssembler().add(_header("x", F32, shape, nbytes))


def test_an_unknown_dtype_is_refused():
    with pytest.raises(wire.WireError, match="tensor 'x': unknown dtype 99"):
        wire.TensorAssembler().add(_header("x", 99, [1], 4))


def test_a_receiver_takes_only_the_tensors_it_expects_within_its_budget():
    expected = wire.Expected(("a", "b"), max_bytes=1000)
    with pytest.raises(
        wire.WireError,
        match=r"tensor 'a': 2147483648 bytes, over the 1000 bytes a request may "
        r"carry here \(0 already announced\)",
    ):
        wire.TensorAssembler(expected).add(_header("a", F32, [2**29], 2**31))  # 2 GiB announced in 20 bytes
    assembler = wire.TensorAssembler(expected)
    for chunk in wire.encode("a", torch.zeros(200)):  # 800 bytes
        assembler.add(chunk)
    with pytest.raises(wire.WireError, match=r"tensor 'b': 400 bytes, over .* \(800 already announced\)"):
        assembler.add(_header("b", F32, [100], 400))
    with pytest.raises(wire.WireError, match=r"unexpected tensor 'xxxx.*\.\.\. \(100000 characters\); send only a, b"):
        wire.TensorAssembler(expected).add(_header("x" * 100_000, F32, [1], 4))


def test_a_spec_stream_is_checked_when_the_spec_arrives():
    from h3serve.v1 import vae_pb2

    def refuse(spec):
        raise ValueError("job_id: refused before any chunk")

    chunks = [vae_pb2.DecodeInput(chunk=c) for c in wire.encode("latents", torch.zeros(3))]
    read = []
    messages = (read.append(m) or m for m in [vae_pb2.DecodeInput(spec=vae_pb2.DecodeSpec()), *chunks])
    with pytest.raises(ValueError, match="refused before any chunk"):
        wire.read_spec_stream(messages, refuse)
    assert len(read) == 1, "no chunk was read"
    spec, tensors = wire.read_spec_stream(
        iter([vae_pb2.DecodeInput(spec=vae_pb2.DecodeSpec()), *chunks]), lambda spec: wire.Expected(("latents",), 12)
    )
    assert torch.equal(tensors["latents"], torch.zeros(3))
