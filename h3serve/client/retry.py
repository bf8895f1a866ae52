"""When and how long the client waits before trying a call again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")

# UNAVAILABLE: the gateway is down, restarting or unreachable. RESOURCE_EXHAUSTED: its job queue is full.
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
        """Wait before the next try, or raise `error` when its code is not retried or no try is left."""
        delay = next(delays, None) if error.code() in self.codes else None
        if delay is None:
            raise error
        time.sleep(delay)

    def call(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, tried again after each retried failure."""
        delays = self.delays()
        while True:
            try:
                return attempt()
            except grpc.RpcError as error:
                self.backoff(error, delays)
