"""Standard Webhooks signing, as OpenAI's SDKs verify it (`client.webhooks.unwrap` / `verify_signature`).

A secret is `whsec_` and the base64 of its key bytes. Each attempt sends `webhook-id` (the event's id, the same on
every attempt, so a receiver drops repeats), `webhook-timestamp` (unix seconds of this attempt: receivers refuse
one more than 5 minutes off) and `webhook-signature` (`v1,` and the base64 HMAC-SHA256 of "id.timestamp.body").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

PREFIX = "whsec_"
KEY_BYTES = 32  # what new_secret draws
MIN_KEY_BYTES = 24


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(PREFIX), validate=True)


def secret_problem(secret: str) -> str | None:
    """Why `secret` is no webhook secret, or None."""
    if not secret.startswith(PREFIX):
        return f"a webhook secret starts with {PREFIX!r} (`h3serve token add` makes one)"
    try:
        key = _key(secret)
    except (binascii.Error, ValueError):
        return f"{PREFIX} and the base64 of the key bytes; this is not base64"
    if len(key) < MIN_KEY_BYTES:
        return f"its key has {len(key)} bytes; at least {MIN_KEY_BYTES}"
    return None


def headers(secret: str, event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The webhook-* headers of one attempt to send `body`."""
    mac = hmac.new(_key(secret), f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1," + base64.b64encode(mac.digest()).decode(),
    }
