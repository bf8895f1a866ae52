"""DiT service: conditioning tensors in, one progress event per denoise step, latents out.

Hosted by rank 0 of the DiT group (h3serve/services/dit/rank.py); the group's driver runs one request
at a time on every rank, a second one waits. A client that cancels stops the loop at the next
step boundary on all ranks. While the group starts or restarts, health is NOT_SERVING and a
request ends UNAVAILABLE with the reason. Every request is checked here first (checks.py): only
requests the model runs reach the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from h3serve.common.config import DiTConfig
from h3serve.model.adapters import AdapterCatalog
from h3serve.model.workflows.base import ModelDims, Workflow
from h3serve.runtime import compile_cache, wire
from h3serve.services.dit import checks
from h3serve.services.dit.group import Driver, JobFailed
from h3serve.v1 import dit_pb2, dit_pb2_grpc

SERVICE_NAME = dit_pb2.DESCRIPTOR.services_by_name["DiT"].full_name


@dataclass
class GroupView:
    """What Info reports about the group; `info` holds the configured workflows, then the group's fields."""

    state: str = "starting"
    info: dit_pb2.DiTInfo = field(default_factory=dit_pb2.DiTInfo)
    driver: Driver | None = None


class DiTServicer(dit_pb2_grpc.DiTServicer):
    def __init__(self, view: GroupView, config: DiTConfig = DiTConfig()) -> None:
        self.view, self.config = view, config

    def _driver(self) -> Driver:
        if self.view.driver is None:
            raise JobFailed(grpc.StatusCode.UNAVAILABLE, f"the DiT group is {self.view.state}")
        return self.view.driver

    def _dims(self, workflow: Workflow) -> ModelDims:
        return checks.model_dims(self._driver().member.runner, workflow)

    def Denoise(self, request_iterator, context):
        try:
            check = checks.DenoiseCheck(
                self.config, list(self.view.info.workflows), self._dims, AdapterCatalog.from_info(self.view.info)
            )
            with wire.refusal_heard(request_iterator):
                spec, tensors = wire.read_spec_stream(request_iterator, check.expect)
            conditioning = check.conditioning(spec, tensors)
            ticket = self._driver().submit(spec, tensors, conditioning)
            context.add_callback(ticket.cancel)
            yield from ticket.stream()
        except ValueError as exc:  # WireError and InvalidRequest included
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except JobFailed as failed:
            context.abort(failed.code, failed.message)

    def Info(self, request, context):
        info = dit_pb2.DiTInfo()
        info.CopyFrom(self.view.info)
        info.state = self.view.state
        info.compiled_graphs, info.compile_cache_hits = compile_cache.compiled_graphs(), compile_cache.cache_hits()
        driver = self.view.driver
        if driver is not None:
            info.requests_served, info.steps_served, info.busy = (
                driver.requests_served,
                driver.steps_served,
                driver.busy,
            )
            for rank, stats in zip(info.ranks, driver.ranks, strict=False):
                rank.peak_bytes, rank.steps_served = stats.peak_bytes, stats.steps_served
        return info
