"""Which URLs a webhook endpoint may be: absolute http(s) URLs of bounded length, no credentials in them.

One rule for both places an endpoint is named: a client's `webhook_url` in the clients file, and a request's
`webhook_url` field; a request's is also held to the hosts the operator allows (`[gateway] webhook_hosts`), so that a
client cannot have the gateway post to a host of the operator's network.
"""

from __future__ import annotations

from urllib.parse import urlsplit

MAX_URL_CHARS = 2048
UNQUOTED = ' "<>\\'  # never bare in a URL (RFC 3986), and they would break the clients file's quoting


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook endpoint, or None when it can."""
    if len(url) > MAX_URL_CHARS:
        return f"at most {MAX_URL_CHARS} characters, got {len(url)}"
    if not url.isascii() or not url.isprintable() or any(char in url for char in UNQUOTED):
        return "printable ASCII without spaces, quotes, '<', '>' or '\\' (percent-encode them)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"an absolute http:// or https:// URL, got {url[:80]!r}"
    if parts.username or parts.password:
        return "no user or password in the URL: the requests are signed (webhook-signature)"
    return None


def host_problem(url: str, hosts: tuple[str, ...]) -> str | None:
    """Why a request may not name `url` (valid by `url_problem`) under `[gateway] webhook_hosts`, or None: any host
    when there are none; else its host is one of them, or under one that starts with "."."""
    host = (urlsplit(url).hostname or "").lower()
    if not hosts or any(host == allowed or (allowed[0] == "." and host.endswith(allowed)) for allowed in hosts):
        return None
    return f"host {host!r} is not one this gateway posts to ([gateway] webhook_hosts: {', '.join(hosts)})"
