"""The Python client of h3serve's public API (docs/client.md): `GatewayClient` over the generated stubs in
h3serve.v1, with TLS, a bearer token, retries, uploads and an iterator of job events.

Pure Python: it imports grpc, protobuf, the standard library and h3serve.v1 only, so it ships alone as the
h3serve-client wheel (`make client`).
"""

from h3serve.client.channel import GATEWAY_ENV, BearerToken, default_address
from h3serve.client.events import TERMINAL, describe_event, is_terminal
from h3serve.client.gateway import GatewayClient, GatewayUnreachable
from h3serve.client.retry import RetryPolicy

__all__ = [
    "GATEWAY_ENV",
    "BearerToken",
    "GatewayClient",
    "GatewayUnreachable",
    "RetryPolicy",
    "TERMINAL",
    "default_address",
    "describe_event",
    "is_terminal",
]
