"""What every h3serve server does around every call, before its servicer runs (sync and asyncio servers alike).

- Bytes that do not decode into the method's request message are INVALID_ARGUMENT, logged as one bounded line.
  gRPC Python answers a deserializer that raises with INTERNAL (sync) or UNKNOWN (asyncio) and logs a traceback,
  so the deserializer never raises here: it hands the servicer an `Undecodable`, which the guard refuses.
- With a token, every method but health and reflection needs the metadata `authorization: Bearer <token>`
  (UNAUTHENTICATED otherwise): the stage token between the gateway and the model services. An asyncio server may
  instead name who calls with its own `Identify` (the gateway's clients, h3serve/gateway/tenants/): the caller it
  returns is `caller()` for the rest of the call, and None refuses the call (UNAUTHENTICATED).
- An exception the servicer did not turn into a status is INTERNAL with its type and first line, never UNKNOWN
  with a traceback; the log keeps the traceback, since it is a bug. A full disk (common/disk.py's DiskFull) is not a
  bug: any call that meets one is RESOURCE_EXHAUSTED naming the disk. Nor is a store out of reach
  (common/errors.py's Unavailable): UNAVAILABLE naming it, with a RetryInfo.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from urllib.parse import unquote

import grpc

from h3serve.common.bounds import brief
from h3serve.common.disk import DiskFull
from h3serve.common.errors import Unavailable
from h3serve.v1 import retry_info

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_KINDS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}

log = logging.getLogger("h3serve.guard")
# (method, the authorization metadata or None, the peer as gRPC names it) -> the caller, or None: refused
Identify = Callable[[str, str | None, str], object | None]
# The caller of the call in progress, as the server's Identify named it (None: no Identify). A call runs in a task
# of its own, so the value is that call's alone.
_CALLER: ContextVar[object | None] = ContextVar("h3serve_caller", default=None)
_TOKEN_HOLDER = object()  # a caller `token` let in: no name


def caller() -> object | None:
    """Who makes the call in progress (an asyncio server with an `Identify`), else None."""
    return _CALLER.get()


def loopback_host(host: str | None) -> bool:
    """An IP address of this machine's loopback (also an IPv4 one mapped into IPv6)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def loopback(peer: str) -> bool:
    """A gRPC peer on this machine: "ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000" (gRPC quotes the brackets), a Unix
    socket."""
    kind, _, address = unquote(peer).partition(":")
    if kind.startswith("unix"):
        return True
    return kind in ("ipv4", "ipv6") and loopback_host(address.rsplit(":", 1)[0].strip("[]"))


@dataclass(frozen=True)
class Undecodable:
    """What the deserializer hands on instead of a message it could not parse."""

    reason: str


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data) if deserializer else data
        except Exception as exc:
            return Undecodable(brief(exc))

    return deserialize


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return _KINDS[(handler.request_streaming, handler.response_streaming)]


def _rebuilt(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """`handler` with `behavior` in place of its own and a deserializer that never raises."""
    factory = getattr(grpc, f"{_kind(handler)}_rpc_method_handler")
    return factory(
        behavior,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def _rpc(method: str) -> str:
    """ "/h3serve.v1.DiT/Denoise" as "h3serve.v1.DiT.Denoise"."""
    return method.strip("/").replace("/", ".")


def _undecodable(method: str, context, request: Undecodable) -> tuple[grpc.StatusCode, str]:
    log.warning("%s from %s: undecodable request: %s", _rpc(method), context.peer(), request.reason)
    return (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request: the bytes sent to {_rpc(method)} do not decode ({request.reason})",
    )


def _internal(method: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
    """The status of an exception the servicer let through, and its trailing metadata: a full disk or a store out
    of reach is the host's state, not a bug, so every call that meets one says so (RESOURCE_EXHAUSTED naming the
    disk; UNAVAILABLE naming the store, with the wait it advises); anything else is INTERNAL, logged with its trace."""
    if isinstance(exc, DiskFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), ()
    if isinstance(exc, Unavailable):
        code = grpc.StatusCode.UNAVAILABLE
        return code, str(exc), retry_info.details(code, str(exc), exc.retry_after_s)
    log.exception("%s: unexpected error", _rpc(method))
    return grpc.StatusCode.INTERNAL, f"{_rpc(method)}: internal error: {brief(exc)}", ()


UNAUTHENTICATED = (
    grpc.StatusCode.UNAUTHENTICATED,
    "authorization: this service needs the metadata 'authorization: Bearer <token>'",
)


def allowed(token: str, details) -> bool:
    """No token set, an open method (health, reflection), or the call carries the token."""
    if not token or details.method.startswith(OPEN_METHODS):
        return True
    given = dict(details.invocation_metadata or ()).get("authorization", "")
    return isinstance(given, str) and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


# Sync servers (the model services).


def _checked(method: str, context, request):
    if isinstance(request, Undecodable):
        context.abort(*_undecodable(method, context, request))
    return request


@contextmanager
def _bugs_are_internal(method: str, context):
    try:
        yield
    except grpc.RpcError:  # the request iterator's word that the client is gone
        raise
    except Exception as exc:
        if context.code() is not None:  # the servicer aborted: its status stands
            raise
        code, message, trailing = _internal(method, exc)
        if trailing:
            context.set_trailing_metadata(trailing)
        context.abort(code, message)


def _guarded(handler: grpc.RpcMethodHandler, method: str, authorized: bool) -> grpc.RpcMethodHandler:
    inner = getattr(handler, _kind(handler))

    def requests(request, context):
        if not authorized:
            context.abort(*UNAUTHENTICATED)
        if handler.request_streaming:
            return (_checked(method, context, item) for item in request)
        return _checked(method, context, request)

    if handler.response_streaming:

        def behavior(request, context):
            with _bugs_are_internal(method, context):
                yield from inner(requests(request, context), context)
    else:

        def behavior(request, context):
            with _bugs_are_internal(method, context):
                return inner(requests(request, context), context)

    return _rebuilt(handler, behavior)


class Guard(grpc.ServerInterceptor):
    """The guard of a sync server; `token` (empty: none) is required on every method but health and reflection."""

    def __init__(self, token: str = "") -> None:
        self.token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        return None if handler is None else _guarded(handler, details.method, allowed(self.token, details))


# Asyncio servers (the gateway).


async def _checked_async(method: str, context, request):
    if isinstance(request, Undecodable):
        await context.abort(*_undecodable(method, context, request))
    return request


async def _checked_stream(method: str, context, requests):
    async for request in requests:
        yield await _checked_async(method, context, request)


@asynccontextmanager
async def _bugs_are_internal_async(method: str, context):
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        await context.abort(*_internal(method, exc))


def _guarded_async(
    handler: grpc.RpcMethodHandler, method: str, authorize: Callable[[str], object | None]
) -> grpc.RpcMethodHandler:
    """A streamed response comes from an async generator, or from a coroutine that writes it with context.write
    (or only aborts). `authorize(peer)`: the caller, None to refuse."""
    inner = getattr(handler, _kind(handler))

    async def requests(request, context):
        who = authorize(context.peer())
        if who is None:
            await context.abort(*UNAUTHENTICATED)
        _CALLER.set(None if who is _TOKEN_HOLDER else who)
        if handler.request_streaming:
            return _checked_stream(method, context, request)
        return await _checked_async(method, context, request)

    if handler.response_streaming:

        async def streamed_behavior(request, context):
            async with _bugs_are_internal_async(method, context):
                responses = inner(await requests(request, context), context)
                if inspect.isawaitable(responses):
                    await responses
                    return
                async for response in responses:
                    yield response

        return _rebuilt(handler, streamed_behavior)

    async def behavior(request, context):
        async with _bugs_are_internal_async(method, context):
            return await inner(await requests(request, context), context)

    return _rebuilt(handler, behavior)


class AsyncGuard(grpc.aio.ServerInterceptor):
    """The guard of an asyncio server; `token` (empty: none) as for `Guard`, or `identify` names each caller."""

    def __init__(self, token: str = "", identify: Identify | None = None) -> None:
        self.token, self.identify = token, identify

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        if self.identify is None:
            verdict = _TOKEN_HOLDER if allowed(self.token, details) else None
            return _guarded_async(handler, details.method, lambda peer: verdict)
        identify, given = self.identify, dict(details.invocation_metadata or ()).get("authorization")
        token = given if isinstance(given, str) else None
        return _guarded_async(handler, details.method, lambda peer: identify(details.method, token, peer))
