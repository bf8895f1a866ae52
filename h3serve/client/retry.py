"""When and how long the client waits before trying a call again.

Only what can succeed on a retry is retried: UNAVAILABLE (the gateway is down, restarting or unreachable) and a
RESOURCE_EXHAUSTED that advises a wait (google.rpc.RetryInfo: the gateway's job queue is full), after at least that
wait. Never a size or validation refusal, nor a full disk: those are answered the same way every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

from h3serve.v1.retry_info import advised_wait_s

T = TypeVar("T")

# RESOURCE_EXHAUSTED only with a retry time (`advised_wait_s`): the transport's "message larger than max" and a full
# disk are RESOURCE_EXHAUSTED too, and no retry fixes them.
RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off: the first wait is `initial_s`, each next one `multiplier` times longer, at most `max_s`;
    a call is tried at most `attempts` times (1: never retried). The defaults wait about 24 s in all, enough for a
    gateway restart."""

    attempts: int = 8
    initial_s: float = 0.25
    max_s: float = 8.0
    multiplier: float = 2.0
    codes: frozenset[grpc.StatusCode] = RETRIED

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_s < 0 or self.max_s < self.initial_s or self.multiplier < 1:
            raise ValueError(f"not a retry policy: {self}")

    def delays(self) -> Iterator[float]:
        """The waits between the tries of one call."""
        return (min(self.initial_s * self.multiplier**i, self.max_s) for i in range(self.attempts - 1))

    def backoff(self, error: grpc.RpcError, delays: Iterator[float]) -> None:
        """Wait before the next try (the back-off's delay, or the refusal's advised wait when longer), or raise
        `error` when it is not worth a retry or no try is left."""
        code, advised = error.code(), advised_wait_s(error)  # type: ignore[attr-defined]  # an RpcError is a Call
        worth = code in self.codes and (code != grpc.StatusCode.RESOURCE_EXHAUSTED or advised is not None)
        delay = next(delays, None) if worth else None
        if delay is None:
            raise error
        time.sleep(max(delay, advised or 0.0))

    def call(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again after each retried failure."""
        delays = self.delays()
        while True:
            try:
                return attempt()
            except grpc.RpcError as error:
                self.backoff(error, delays)
