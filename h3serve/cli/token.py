"""`h3serve token add NAME`: a new client token for the gateway's clients file, printed once, stored as its hash.

The client's table is appended to the file ([gateway] clients_file: --config's, or --file); a running gateway reads
it on SIGHUP. With --webhook-url (or --webhook-secret) a `whsec_` secret is made too and printed once, for the
client's receiver to verify the gateway's events with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from h3serve.common.config import load_deploy
from h3serve.gateway.tenants.clients import NAME, ClientsFileError, entry, new_token, read
from h3serve.gateway.webhooks.endpoint import url_problem
from h3serve.gateway.webhooks.signing import new_secret


def _clients_file(args) -> Path:
    path = args.file or (load_deploy(args.config).gateway.clients_file if args.config else "")
    if not path:
        raise SystemExit(
            "h3serve token add: name the clients file with --file, or --config with [gateway] clients_file"
        )
    return Path(path)


def _add(args) -> None:
    path = _clients_file(args)
    if not NAME.fullmatch(args.name):
        raise SystemExit(f"h3serve token add: {args.name!r}: 1-64 letters, digits, '_', '.', '-'")
    if args.webhook_url and (problem := url_problem(args.webhook_url)):
        raise SystemExit(f"h3serve token add: --webhook-url: {problem}")
    try:
        known = read(path) if path.exists() else {}
    except ClientsFileError as exc:
        raise SystemExit(f"h3serve token add: {exc}") from None
    if any(client.name == args.name for client in known.values()):
        raise SystemExit(f"h3serve token add: {path} already has a client {args.name!r}")
    token = new_token()
    secret = new_secret() if args.webhook_url or args.webhook_secret else ""
    table = entry(args.name, token, args.admin, args.webhook_url, secret)
    # owner-only: the file holds the webhook secrets in clear (they sign), and the tokens' hashes
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as file:
        file.write(("\n" if path.stat().st_size else "") + table)
    print(token)
    if secret:
        print(f"webhook secret: {secret}")
    print(
        f"client {args.name!r} added to {path}; the token is not stored: keep it now. "
        "A running gateway takes it on SIGHUP.",
        file=sys.stderr,
    )


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("token", help="manage the gateway's client tokens (the clients file)")
    verbs = p.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="append a new client with a fresh token; prints the token once")
    add.add_argument("name", help="the client's name: 1-64 letters, digits, '_', '.', '-'")
    add.add_argument("--file", help="the clients file (default: --config's [gateway] clients_file)")
    add.add_argument("--config", help="deployment TOML file")
    add.add_argument("--admin", action="store_true", help="the client sees and acts on every client's jobs")
    add.add_argument("--webhook-url", default="", help="POST this client's job ends here (a secret is made)")
    add.add_argument("--webhook-secret", action="store_true", help="make a webhook secret (requests name the URL)")
    add.set_defaults(run=_add)
