"""Prometheus metrics of the gateway, on their own registry and HTTP port.

Job counts by state are read from the store at scrape time (so they are right after a restart);
everything else is counted as it happens. Who may scrape is the gateway's to say (tenants: an admin token, or a
caller that [gateway] open_without_token lets in); a scrape it refuses is 401.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from h3serve.v1 import gateway_pb2

_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class _Snapshot:
    """A collector that reads gauges from callables at scrape time."""

    def __init__(self, jobs_by_state: Callable[[], dict[int, int]], queue_depths: Callable[[], dict[str, int]]):
        self.jobs_by_state, self.queue_depths = jobs_by_state, queue_depths

    def collect(self):
        jobs = GaugeMetricFamily("h3serve_jobs", "Jobs in the store by state", labels=["state"])
        counts = self.jobs_by_state()
        for name, value in gateway_pb2.JobState.items():
            if value:
                jobs.add_metric([name.removeprefix("JOB_STATE_").lower()], counts.get(value, 0))
        yield jobs
        depth = GaugeMetricFamily("h3serve_stage_queue_depth", "Jobs waiting for a worker of a stage", labels=["stage"])
        for stage, value in self.queue_depths().items():
            depth.add_metric([stage], value)
        yield depth


class GatewayMetrics:
    def __init__(self, stages: tuple[str, ...]) -> None:
        """`stages`: the stage names, whose series are created at zero so a scrape shows them from the start."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.stage_seconds = Histogram(
            "h3serve_stage_seconds",
            "Wall time of a successful stage pass, queue excluded",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "h3serve_stage_queue_seconds",
            "Time a job waited for a stage worker",
            ["stage"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "h3serve_denoise_step_seconds",
            "Wall time of one denoise step in the DiT",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.cache = Counter(
            "h3serve_embedding_cache", "Encoder calls by embedding cache result", ["result"], registry=r
        )
        self.tensor_bytes = Counter(
            "h3serve_tensor_bytes",
            "Tensor and file bytes moved between gateway and stages",
            ["stage", "direction"],
            registry=r,
        )
        self.stage_retries = Counter(
            "h3serve_stage_retries", "Stage calls tried again after a transient failure", ["stage"], registry=r
        )
        self.job_retries = Counter(
            "h3serve_job_retries", "Jobs run again (gateway restart or stalled stage)", ["reason"], registry=r
        )
        self.stalls = Counter("h3serve_stalls", "Stage calls cancelled by the watchdog", ["phase"], registry=r)
        self.compiled_graphs = Counter(
            "h3serve_dit_compiled_graphs",
            "Graphs the DiT compiled inside requests (shapes not warmed; those steps were slower)",
            registry=r,
        )
        for stage in stages:
            self.stage_retries.labels(stage)
            for direction in ("in", "out"):
                self.tensor_bytes.labels(stage, direction)
        for result in ("hit", "miss"):
            self.cache.labels(result)

    def watch(self, jobs_by_state: Callable[[], dict[int, int]], queue_depths: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_Snapshot(jobs_by_state, queue_depths))

    def serve(self, host: str, port: int, allowed: Callable[[str | None, str | None], bool] | None = None):
        """Start the /metrics HTTP server on a thread of its own; returns (server, thread). `allowed(authorization,
        client address)` decides each request (None: every one)."""
        app = make_wsgi_app(self.registry)
        if allowed is not None:
            app = _guarded(app, allowed)

        class Server(ThreadingWSGIServer):
            address_family = socket.getaddrinfo(host, port)[0][0]  # an IPv6 host too

        server = make_server(host, port, app, Server, handler_class=_Quiet)
        thread = threading.Thread(target=server.serve_forever, name="h3serve-metrics", daemon=True)
        thread.start()
        return server, thread


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape every few seconds is no news
        pass


REFUSED = b"authorization: /metrics needs the header 'authorization: Bearer <an admin client's token>'\n"


def _guarded(app, allowed: Callable[[str | None, str | None], bool]):
    def guarded(environ, start_response):
        if allowed(environ.get("HTTP_AUTHORIZATION"), environ.get("REMOTE_ADDR")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("content-type", "text/plain"), ("www-authenticate", "Bearer")])
        return [REFUSED]

    return guarded
