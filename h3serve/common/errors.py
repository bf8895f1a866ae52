"""Error reporting across the gRPC boundary: always keep the end of an error, where the cause is."""

from __future__ import annotations

import traceback

MAX_ERROR_CHARS = 4000


def tail(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The last `limit` characters, cut at a line start, marked when shortened."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    return "...\n" + (cut[newline + 1 :] if 0 <= newline < limit // 2 else cut)


def describe(exc: BaseException, lines: int = 6) -> str:
    """The exception's own message plus the last traceback lines, trimmed from the front."""
    formatted = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return tail("\n".join(formatted[-lines:]))


class Unavailable(Exception):
    """Something the server needs (the gateway's job store) is unreachable for now: any call that meets it is
    UNAVAILABLE with the wait this advises (common/guard.py), worth a retry, never a bug."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
