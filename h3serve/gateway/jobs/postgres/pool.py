"""The store's connections to PostgreSQL: psycopg's async pool, with a server out of reach said as one error.

Every method of the store takes its connection here, so a server that is down, restarting or cut off surfaces as
StoreUnavailable naming it (host:port/database, never the password), from the connection's wait as from a statement
cut off mid-way; the errors PostgreSQL itself answers (a constraint, a Fenced write) stay as they are. Each connection
is checked as it leaves the pool, so the first call after the server comes back finds a live one, not a stale one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from psycopg import AsyncConnection, OperationalError
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from h3serve.common.bounds import brief
from h3serve.gateway.jobs.store import StoreUnavailable

WAIT_S = 5.0  # how long a call waits for a connection while the server is out of reach, before StoreUnavailable
PING_WAIT_S = 1.0  # the same for the health's ping: within a probe's usual 1 s timeout
# How long the pool keeps trying one new connection, its waits doubling from 1 s: the pool's own default (5 min) lets
# them grow to minutes, so a server back after a long outage would wait that long for its first connection. Given up
# sooner, the next call that waits starts a fresh try at once: a server back is used within about RECONNECT_S / 2.
RECONNECT_S = 4.0
RETRY_AFTER_S = 5.0  # the wait an UNAVAILABLE refusal advises its client (RetryInfo, HTTP Retry-After)
# SQLSTATEs that mean the server, not the statement: class 08 (the connection failed or broke), the server shutting
# down or starting (57P01-57P03), and its connection slots all taken (53300).
_UNREACHABLE_STATES = ("08", "57P01", "57P02", "57P03", "53300")


def server_name(url: str) -> str:
    """The server a libpq URL names, for messages: "PostgreSQL at host:port/database" (a socket directory as host)."""
    parts = conninfo_to_dict(url)
    host = parts.get("host") or "localhost"
    return f"PostgreSQL at {host}:{parts.get('port') or 5432}/{parts.get('dbname') or parts.get('user') or ''}"


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the server could not be reached or dropped us, rather than refusing a statement."""
    if isinstance(exc, PoolTimeout):
        return True
    if not isinstance(exc, OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith(_UNREACHABLE_STATES)


class Pool:
    """An AsyncConnectionPool of autocommit connections to `url`; open with `open`."""

    def __init__(self, url: str, max_size: int) -> None:
        self.server = server_name(url)
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            open=False,
            kwargs={"autocommit": True},
            check=AsyncConnectionPool.check_connection,
            reconnect_timeout=RECONNECT_S,
        )

    async def open(self, timeout_s: float) -> None:
        await self._pool.open(wait=True, timeout=timeout_s)

    async def close(self) -> None:
        await self._pool.close()

    @asynccontextmanager
    async def connection(self, wait_s: float = WAIT_S) -> AsyncIterator[AsyncConnection]:
        """A connection for one call; a server out of reach, at the wait or inside the call, is StoreUnavailable
        (the call's transaction did not commit, unless the server went away between its commit and its answer)."""
        try:
            async with self._pool.connection(timeout=wait_s) as conn:
                yield conn
        except Exception as exc:
            if unreachable(exc):
                raise StoreUnavailable(self.server, brief(exc), RETRY_AFTER_S) from exc
            raise
