"""The gateway's Prometheus series over the run: /metrics scraped every `every_s` on a thread of its own.

Only h3serve's own series are kept (not the process_* / python_* ones). A scrape that fails (the gateway
restarting) is counted and skipped: the series have gaps, the experiment goes on.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "h3serve_"
TIMEOUT_S = 5.0


def series_key(name: str, labels: dict[str, str]) -> str:
    """Prometheus' own notation: name{label="value",...}, labels sorted."""
    inner = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def parse(text: str) -> dict[str, float]:
    return {
        series_key(sample.name, sample.labels): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(PREFIX)
    }


@dataclass
class Scrapes:
    url: str
    scrapes: list[dict] = field(default_factory=list)  # {"time": unix seconds, "series": {key: value}}
    failures: int = 0

    def as_json(self) -> dict:
        return {"url": self.url, "failures": self.failures, "scrapes": self.scrapes}


class Scraper:
    """A context manager: scrapes from entry until exit, once more at exit."""

    def __init__(self, url: str, every_s: float) -> None:
        self.data, self.every_s = Scrapes(url), every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="experiment-scrape", daemon=True)

    def scrape(self) -> None:
        try:
            with urllib.request.urlopen(self.data.url, timeout=TIMEOUT_S) as reply:
                text = reply.read().decode()
        except OSError:
            self.data.failures += 1
            return
        self.data.scrapes.append({"time": time.time(), "series": parse(text)})

    def _loop(self) -> None:
        while True:
            self.scrape()
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.scrape()
