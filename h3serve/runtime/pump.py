"""Run blocking model work in a thread while an RPC generator streams the events it emits.

A servicer's response generator cannot yield from inside a model callback, so the work runs
on a worker thread and hands events over a queue. The work's result is the return value of
`yield from pump(...)`; its exception is re-raised in the RPC thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator
from typing import Any

_END = object()


class ClientGone(BaseException):
    """The RPC's client went away; raised from a progress callback to stop model work early.

    A BaseException, like KeyboardInterrupt, so diffusers' `except Exception` error logging lets it
    pass quietly.
    """


def pump(work: Callable[[Callable[[Any], None]], Any]) -> Generator[Any, None, Any]:
    """`work(emit)` runs on a thread; every `emit(event)` is yielded here in order."""
    events: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = work(events.put)
        except BaseException as exc:  # handed to the RPC thread, which decides the status
            outcome["error"] = exc
        finally:
            events.put(_END)

    thread = threading.Thread(target=target, name="model-work", daemon=True)
    thread.start()
    while (event := events.get()) is not _END:
        yield event
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
