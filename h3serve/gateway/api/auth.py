"""Bearer-token check on the public API (health and reflection stay open for probes)."""

from __future__ import annotations

import hmac

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        given = dict(metadata or ()).get("authorization", "")
        return hmac.compare_digest(given.encode(), self._expected)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES) or self._authorized(
                details.invocation_metadata):
            return handler
        return _refusing(handler)


async def _refuse(_request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "authorization: this gateway needs the metadata 'authorization: Bearer <token>'")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_refuse, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_refuse, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(_refuse, **codec)
