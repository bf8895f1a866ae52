"""The workflow registry: every MiniMax-H3 workflow h3serve serves, one module each (see base.py)."""

from __future__ import annotations

from h3serve.model.rules import InvalidRequest
from h3serve.model.workflows.base import Workflow
from h3serve.model.workflows.fl2va import FL2VA
from h3serve.model.workflows.ref2va import REF2VA
from h3serve.model.workflows.t2va import T2VA
from h3serve.v1 import common_pb2, gateway_pb2

WORKFLOWS: tuple[Workflow, ...] = (T2VA(), FL2VA(), REF2VA())
_BY_VALUE: dict[int, Workflow] = {w.value: w for w in WORKFLOWS}
_BY_NAME = {w.name: w for w in WORKFLOWS}


def by_value(value: int) -> Workflow:
    """The workflow of a `common_pb2.Workflow` value (unspecified: t2va, as the stages read it)."""
    if value == common_pb2.WORKFLOW_UNSPECIFIED:
        return _BY_VALUE[common_pb2.WORKFLOW_T2VA]
    if value not in _BY_VALUE:
        raise ValueError(f"workflow: unknown value {value}; one of {', '.join(names())}")
    return _BY_VALUE[value]


def by_name(name: str) -> Workflow:
    if name not in _BY_NAME:
        raise ValueError(f"workflow: unknown {name!r}; one of {', '.join(names())}")
    return _BY_NAME[name]


def names() -> list[str]:
    return [w.name for w in WORKFLOWS]


def asset_fields(request) -> list[tuple[str, str]]:
    """(field, asset id) of every media field of any workflow a GenerateRequest or ResolvedRequest sets."""
    found: list[tuple[str, str]] = []
    for workflow in WORKFLOWS:
        for field in workflow.media_fields:
            value = getattr(request, field)
            found += (
                [(field, value)]
                if isinstance(value, str)
                else [(f"{field}[{index}].asset_id", item.asset_id) for index, item in enumerate(value)]
            )
    return [(field, asset_id) for field, asset_id in found if asset_id]


def asset_ids(request) -> list[str]:
    """Every asset id a GenerateRequest or ResolvedRequest names in the media fields of any workflow."""
    return [asset_id for _, asset_id in asset_fields(request)]


def of_fields(fields) -> Workflow:
    """The workflow whose media `fields` (GenerateRequest field names) carry; none: t2va. With media of two
    workflows, the later one in the registry (the request is then refused for the other's fields)."""
    owners = [w for w in WORKFLOWS if set(fields) & set(w.media_fields)]
    return owners[-1] if owners else _BY_VALUE[common_pb2.WORKFLOW_T2VA]


def of_request(request: gateway_pb2.GenerateRequest) -> Workflow:
    """The requested workflow, or the one its media imply; a media field of another workflow is refused."""
    given = [field for w in WORKFLOWS for field in w.media_fields if getattr(request, field)]
    workflow = of_fields(given)
    if request.workflow:
        try:
            workflow = by_value(request.workflow)
        except ValueError as exc:
            raise InvalidRequest(
                "workflow", f"unknown value {request.workflow}; one of {', '.join(n.upper() for n in names())}"
            ) from exc
    for field in given:
        if field not in workflow.media_fields:
            owner = of_fields([field])
            taken = ", ".join(workflow.media_fields) or "no media"
            raise InvalidRequest(field, f"{owner.name} media; a {workflow.name} request takes {taken}")
    return workflow
