"""The channel to a gateway: TLS when given a root certificate, a bearer token on every call."""

from __future__ import annotations

import os
from collections import namedtuple

import grpc

# Where a client looks for the gateway when not told: $H3SERVE_GATEWAY, else a local one on the gateway's default
# port ([gateway] port). `h3serve generate` uses the same default.
GATEWAY_ENV = "H3SERVE_GATEWAY"
LOCAL_GATEWAY = "127.0.0.1:50050"

# Unlimited message sizes, as h3serve's servers set them (h3serve.common.server, which the client does not import);
# a lost gateway is dialled again at least every second (gRPC's default waits up to 2 minutes), so a retried call
# finds a restarted one at once.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _CallDetails(
    namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"), grpc.ClientCallDetails
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call (metadata, so it also works without TLS)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _call(self, continuation, details, request):
        metadata = [*(details.metadata or ()), self.header]
        return continuation(
            _CallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
                details.compression,
            ),
            request,
        )

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _call


def default_address() -> str:
    """The gateway's host:port from $H3SERVE_GATEWAY, else LOCAL_GATEWAY."""
    return os.environ.get(GATEWAY_ENV) or LOCAL_GATEWAY


def open_channel(address: str, root_pem: bytes | None, token: str | None) -> grpc.Channel:
    """`root_pem`: PEM root certificate(s) of a TLS gateway (None: plaintext); `token`: None or empty sends none."""
    if root_pem is None:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_pem), options=CHANNEL_OPTIONS)
    return grpc.intercept_channel(channel, BearerToken(token)) if token else channel
