"""The guard around every call (h3serve/common/guard.py), on in-process sync and asyncio servers: undecodable bytes,
a servicer's bug, the token, and every call shape."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from h3serve.common.guard import AsyncGuard, Guard
from h3serve.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, gateway_pb2, gateway_pb2_grpc


class Encoder(encoder_pb2_grpc.EncoderServicer):
    def Info(self, request, context):
        return encoder_pb2.EncoderInfo(max_prompt_chars=7)

    def Encode(self, request, context):
        if request.prompt == "bug":
            raise RuntimeError("a bug\nwith more lines")
        yield encoder_pb2.EncodeReply(summary=encoder_pb2.EncodeSummary(num_tokens=len(request.prompt)))


@pytest.fixture()
def encoder():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[Guard("s3cret")])
    encoder_pb2_grpc.add_EncoderServicer_to_server(Encoder(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(None)


TOKEN = (("authorization", "Bearer s3cret"),)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_a_sync_server_refuses_undecodable_bytes_a_missing_token_and_reports_a_bug_as_internal(encoder, caplog):
    stub = encoder_pb2_grpc.EncoderStub(encoder)
    raw = encoder.unary_unary("/h3serve.v1.Encoder/Info", request_serializer=None, response_deserializer=None)
    code, details = _code(lambda: raw(b"\xff\xff", metadata=TOKEN))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("request: the bytes sent to h3serve.v1.Encoder.Info do not decode (DecodeError: ")
    assert [r.message.count("\n") for r in caplog.records if "undecodable" in r.message] == [0], "one line"
    assert _code(lambda: stub.Info(common_pb2.InfoRequest()))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert stub.Info(common_pb2.InfoRequest(), metadata=TOKEN).max_prompt_chars == 7
    code, details = _code(lambda: list(stub.Encode(encoder_pb2.EncodeRequest(prompt="bug"), metadata=TOKEN)))
    assert (code, details) == (
        grpc.StatusCode.INTERNAL,
        "h3serve.v1.Encoder.Encode: internal error: RuntimeError: a bug",
    )
    assert list(stub.Encode(encoder_pb2.EncodeRequest(prompt="abc"), metadata=TOKEN))[0].summary.num_tokens == 3


class Gateway(gateway_pb2_grpc.GatewayServicer):
    async def Watch(self, request, context):
        yield gateway_pb2.JobEvent(job_id=request.job_id)

    async def UploadAsset(self, request_iterator, context):
        return gateway_pb2.Asset(bytes=sum([len(chunk.data) async for chunk in request_iterator]))


async def _gateway_calls(token: str) -> dict[str, grpc.StatusCode]:
    server = grpc.aio.server(interceptors=[AsyncGuard(token)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(Gateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        upload = channel.stream_unary(
            "/h3serve.v1.Gateway/UploadAsset", request_serializer=None, response_deserializer=None
        )

        async def chunks(*raw: bytes):
            for data in raw:
                yield data

        calls = {
            "watch": lambda md: _collect(stub.Watch(gateway_pb2.WatchRequest(job_id="j"), metadata=md)),
            "upload": lambda md: upload(
                chunks(gateway_pb2.UploadAssetChunk(data=b"abc").SerializeToString()), metadata=md
            ),
            "undecodable upload": lambda md: upload(chunks(b"\x12\x01a", b"\xff\xff"), metadata=md),
        }
        for name, call in calls.items():
            for authorized, metadata in (("with token", (("authorization", f"Bearer {token}"),)), ("without", ())):
                try:
                    await call(metadata)
                    codes[f"{name} {authorized}"] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    codes[f"{name} {authorized}"] = err.code()
    await server.stop(None)
    return codes


async def _collect(call) -> list:
    return [reply async for reply in call]


def test_an_asyncio_server_guards_every_call_shape_behind_its_bearer_token():
    """The bearer refusal of a streamed method is a coroutine that only aborts: the guard awaits it."""
    assert asyncio.run(_gateway_calls("s3cret")) == {
        "watch with token": grpc.StatusCode.OK,
        "watch without": grpc.StatusCode.UNAUTHENTICATED,
        "upload with token": grpc.StatusCode.OK,
        "upload without": grpc.StatusCode.UNAUTHENTICATED,
        "undecodable upload with token": grpc.StatusCode.INVALID_ARGUMENT,
        "undecodable upload without": grpc.StatusCode.UNAUTHENTICATED,
    }
