"""Client-chosen strings at a service boundary: ids are checked, everything echoed is cut.

No request may make a refusal or a log line large: an id (job, request, asset) is printable ASCII without
spaces and at most MAX_ID_CHARS long, and any other client text a service repeats (a tensor's or a file's
name, a parser's complaint) is cut to SHOWN_CHARS first.
"""

from __future__ import annotations

from h3serve.model.rules import InvalidRequest

MAX_ID_CHARS = 128
SHOWN_CHARS = 200


def check_id(field: str, value: str) -> str:
    """`value` when it is a usable id; InvalidRequest naming `field` otherwise (without echoing it)."""
    if len(value) > MAX_ID_CHARS or not all(" " < c <= "~" for c in value):
        raise InvalidRequest(
            field, f"at most {MAX_ID_CHARS} printable ASCII characters without spaces, got {len(value)} characters"
        )
    return value


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text`, cut to `limit` characters with a note of its length when longer."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """A client's string quoted for a message: repr of the cut text, so control characters stay visible."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def brief(exc: BaseException) -> str:
    """An exception as one bounded line: its type and the first line of its message, no traceback."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {clip(lines[0])}" if lines else type(exc).__name__


def without_path(message: str, path: str, name: str) -> str:
    """A decoder's message about the server's file at `path`, naming the client's `name` instead."""
    return message.replace(path, name)
