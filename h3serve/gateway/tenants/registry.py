"""`Tenants`: who a call's bearer token names, from [gateway] auth_token and the clients file, reloaded on SIGHUP.

With neither set the gateway is open: every caller is the `default` client, as before tenants existed. With either,
every method needs a token but health (always open: supervisors and load balancers probe it) and what
`[gateway] open_without_token` opens: "reflection" (gRPC server reflection), "docs" (the HTTP door's
/openapi.json and /docs) and "metrics" (Prometheus, else an admin's token), to everyone, or with "@loopback" only
to callers on this machine. `auth_token` is the `default` client's token, which owns the jobs made before tenants
existed.
"""

from __future__ import annotations

import hmac
import logging
import threading

from h3serve.common.config import GatewayConfig
from h3serve.common.guard import OPEN_METHODS, loopback, loopback_host
from h3serve.gateway.tenants.clients import DEFAULT, Client, ClientsFileError, read, token_hash

log = logging.getLogger("h3serve.gateway.tenants")
REFLECTION = "/grpc.reflection."
HEALTH = tuple(prefix for prefix in OPEN_METHODS if prefix != REFLECTION)
DEFAULT_CLIENT = Client(DEFAULT)  # auth_token's client; also the caller of an open gateway or an open method


class Tenants:
    def __init__(self, config: GatewayConfig) -> None:
        """Reads the clients file: ClientsFileError when it cannot be used."""
        self.path, self.auth_token = config.clients_file, config.auth_token
        self.per_client_bound = config.max_unfinished_jobs_per_client
        self.open_parts = set(config.open_without_token)
        self._lock = threading.Lock()  # the metrics server's thread reads the clients too
        self._by_hash: dict[str, Client] = read(self.path) if self.path else {}
        if self.path:
            log.info("clients file %s: %d client(s); SIGHUP reads it again", self.path, len(self._by_hash))

    @property
    def guarded(self) -> bool:
        """Whether calls need a token."""
        return bool(self.auth_token or self.path)

    def reload(self) -> bool:
        """Read the clients file again (SIGHUP); a file that cannot be used is logged and the clients stay."""
        if not self.path:
            return False
        try:
            clients = read(self.path)
        except ClientsFileError as exc:
            log.error("the clients stay as they were: %s", exc)
            return False
        with self._lock:
            self._by_hash = clients
        log.info("clients file %s read again: %d client(s)", self.path, len(clients))
        return True

    def clients(self) -> list[Client]:
        with self._lock:
            return list(self._by_hash.values())

    def named(self, name: str) -> Client | None:
        """The client of that name as the file says now (`default`: auth_token's)."""
        if name == DEFAULT:
            return DEFAULT_CLIENT
        return next((client for client in self.clients() if client.name == name), None)

    def by_token(self, authorization: str | None) -> Client | None:
        """The client an `authorization: Bearer <token>` value names; an open gateway's anonymous caller; else None."""
        if not self.guarded:
            return DEFAULT_CLIENT
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization.removeprefix("Bearer ")
        if self.auth_token and hmac.compare_digest(token.encode(), self.auth_token.encode()):
            return DEFAULT_CLIENT
        with self._lock:
            return self._by_hash.get(token_hash(token))

    def is_open(self, part: str, local: bool) -> bool:
        """Whether `part` ("docs", "reflection", "metrics") answers without a token to a caller (`local`: on this
        machine)."""
        return part in self.open_parts or (local and f"{part}@loopback" in self.open_parts)

    def identify(self, method: str, authorization: str | None, peer: str) -> Client | None:
        """common/guard.py's Identify: the caller, or None to refuse the call."""
        if method.startswith(HEALTH) or (method.startswith(REFLECTION) and self.is_open("reflection", loopback(peer))):
            return self.by_token(authorization) or DEFAULT_CLIENT
        return self.by_token(authorization)

    def docs_allowed(self, authorization: str | None, host: str | None) -> bool:
        """Whether the HTTP door shows its OpenAPI document and /docs to a caller from `host` (an IP address)."""
        return self.by_token(authorization) is not None or self.is_open("docs", loopback_host(host))

    def metrics_allowed(self, authorization: str | None, host: str | None) -> bool:
        """Whether a Prometheus scrape from `host` is served: every client's counts are in it, so an admin's token,
        or a caller `open_without_token` lets in ("metrics", "metrics@loopback")."""
        if not self.guarded or self.is_open("metrics", loopback_host(host)):
            return True
        client = self.by_token(authorization)
        return client is not None and client.admin

    def bound(self, client: Client) -> int:
        """The client's bound on unfinished jobs (0: none)."""
        return self.per_client_bound if client.max_unfinished_jobs is None else client.max_unfinished_jobs
