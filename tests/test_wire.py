"""The tensor wire codec: exact round trips, any size through real gRPC, clear errors on bad streams."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from h3serve.runtime import wire
from h3serve.v1 import tensor_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact(dtype):
    source = (torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 1000).to(dtype)
    chunks = wire.encode("x", source, chunk_bytes=64)
    assert len(chunks) > 1
    out = wire.decode(chunks, "x")["x"]
    assert out.dtype == dtype and out.shape == source.shape
    assert torch.equal(out.view(torch.uint8) if dtype == torch.bool else out, source.view(torch.uint8)
                       if dtype == torch.bool else source)


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

    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.stream_stream_rpc_method_handler(
            echo, request_deserializer=tensor_pb2.TensorChunk.FromString,
            response_serializer=tensor_pb2.TensorChunk.SerializeToString)})
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
            echo = channel.stream_stream("/test.Echo/Echo", request_serializer=tensor_pb2.TensorChunk.SerializeToString,
                                         response_deserializer=tensor_pb2.TensorChunk.FromString)
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
