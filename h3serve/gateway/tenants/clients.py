"""The clients file ([gateway] clients_file): one TOML table per client, its token kept only as a SHA-256 hash.

    [clients.alice]
    token_sha256 = "<64 hex digits>"   # sha256 of the token; the token itself is printed once by `h3serve token add`
    admin = false                      # true: sees and acts on every client's jobs
    max_unfinished_jobs = 8            # this client's bound on queued + running jobs (absent: [gateway]
                                       # max_unfinished_jobs_per_client)
    webhook_url = "https://..."        # where its jobs' ends are POSTed (absent: only jobs that name one)
    webhook_secret = "whsec_..."       # signs them; needed for any webhook of this client

A plain SHA-256 suffices because tokens are 256 random bits (`new_token`), not passwords: no dictionary reaches
them, and a slow hash would be paid on every call. The file is read whole and checked; a bad one names the client
and key, and is refused at start, or kept out (the clients before it stay) when a SIGHUP reloads it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator

from h3serve.gateway.webhooks.endpoint import url_problem
from h3serve.gateway.webhooks.signing import secret_problem

DEFAULT = "default"  # the client of [gateway] auth_token, and of every caller of a gateway with no token at all
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
TOKEN_PREFIX = "h3t_"


class ClientsFileError(ValueError):
    """The clients file cannot be used; the message names the file, the client and the key."""


@dataclass(frozen=True)
class Client:
    name: str
    admin: bool = False
    max_unfinished_jobs: int | None = None  # None: the gateway's per-client default
    webhook_url: str = ""
    webhook_secret: str = ""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    token_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    admin: bool = False
    max_unfinished_jobs: NonNegativeInt | None = None
    webhook_url: str = ""
    webhook_secret: str = ""

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, url: str) -> str:
        if url and (problem := url_problem(url)):
            raise ValueError(problem)
        return url

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, secret: str) -> str:
        if secret and (problem := secret_problem(secret)):
            raise ValueError(problem)
        return secret


def read(path: str | Path) -> dict[str, Client]:
    """The clients by their token's hash. ClientsFileError: unreadable, not TOML, or a client or key refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ClientsFileError(f"clients file {path}: {exc}") from None
    unknown = sorted(set(data) - {"clients"})
    tables = data.get("clients", {})
    if unknown or not isinstance(tables, dict):
        raise ClientsFileError(f"clients file {path}: only [clients.NAME] tables belong here, found {unknown or data}")
    by_hash: dict[str, Client] = {}
    for name, table in tables.items():
        where = f"clients file {path} [clients.{name}]"
        if not NAME.fullmatch(name) or name == DEFAULT:
            raise ClientsFileError(
                f"{where}: a client name is 1-64 letters, digits, '_', '.', '-' (first a letter or digit), and not "
                f"{DEFAULT!r} ([gateway] auth_token's client)"
            )
        try:
            entry = _Entry.model_validate(table)
        except ValidationError as error:
            problem = error.errors()[0]
            key = ".".join(str(part) for part in problem["loc"])
            raise ClientsFileError(f"{where} {key}: {problem['msg'].removeprefix('Value error, ')}") from None
        if entry.webhook_url and not entry.webhook_secret:
            raise ClientsFileError(f"{where} webhook_url: needs a webhook_secret to sign its events")
        if entry.token_sha256 in by_hash:
            raise ClientsFileError(
                f"{where} token_sha256: the same token as [clients.{by_hash[entry.token_sha256].name}]"
            )
        by_hash[entry.token_sha256] = Client(
            name, entry.admin, entry.max_unfinished_jobs, entry.webhook_url, entry.webhook_secret
        )
    return by_hash


def entry(name: str, token: str, admin: bool = False, webhook_url: str = "", webhook_secret: str = "") -> str:
    """A client's table, as `h3serve token add` appends it."""
    lines = [f"[clients.{name}]", f'token_sha256 = "{token_hash(token)}"']
    if admin:
        lines.append("admin = true")
    if webhook_url:
        lines.append(f'webhook_url = "{webhook_url}"')
    if webhook_secret:
        lines.append(f'webhook_secret = "{webhook_secret}"')
    return "\n".join(lines) + "\n"
