"""The live progress display: one line, rewritten in place, from a thread of its own."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO


@dataclass
class Counts:
    planned: int | None  # the job bound, if any
    submitted: int = 0
    done: int = 0
    failed: int = 0  # failed or cancelled
    rejected: int = 0  # Submit refused: the gateway's queue was full
    latencies: list[float] = field(default_factory=list)

    def line(self, elapsed_s: float) -> str:
        running = self.submitted - self.done - self.failed
        of = f"/{self.planned}" if self.planned else ""
        p50 = f"  p50 {statistics.median(self.latencies):.2f} s" if self.latencies else ""
        return (
            f"{elapsed_s:6.1f} s  submitted {self.submitted}{of}  running {running}  done {self.done}  "
            f"failed {self.failed}  rejected {self.rejected}{p50}"
        )


class Progress:
    """Counts updated by the driver's threads (under `lock`), shown every `every_s` on `stream` (None: silent)."""

    def __init__(self, planned: int | None, stream: TextIO | None, every_s: float = 0.5) -> None:
        self.counts, self.stream, self.every_s = Counts(planned), stream, every_s
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._show, name="experiment-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._print(end="\n")

    def _print(self, end: str = "") -> None:
        if self.stream is not None:
            with self.lock:
                line = self.counts.line(time.monotonic() - self.started)
            print(f"\r\x1b[K{line}", end=end, file=self.stream, flush=True)

    def _show(self) -> None:
        while not self._stop.wait(self.every_s):
            self._print()
