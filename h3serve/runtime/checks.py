"""What the model services check of a request before any work, where more than one of them checks it.

The rules are the model's (h3serve/model/rules.py) and each workflow's (h3serve/model/workflows); this module
applies them to the internal messages. Every refusal is a ValueError whose message starts with the field or
tensor it names, which the services answer with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from h3serve.common.bounds import check_id
from h3serve.model import rules, workflows
from h3serve.model.rules import Geometry, InvalidRequest
from h3serve.model.workflows.base import MediaError
from h3serve.v1 import media_pb2


def spec_checked(messages: Iterable, check: Callable[[Any], None]) -> Iterator:
    """`messages` passed through, each `spec` message checked before anything after it is read."""
    for message in messages:
        if message.WhichOneof("kind") == "spec":
            check(message.spec)
        yield message


def check_media_spec(spec: media_pb2.MediaSpec, geometry: Geometry, max_input_bytes: int) -> None:
    """A MediaSpec (Encoder.EncodeMedia, VAE.EncodeConditions) before any asset byte is read."""
    check_id("job_id", spec.job_id)
    workflow = workflows.by_value(spec.workflow)
    if not workflow.media_fields:
        raise MediaError(f"workflow: {workflow.name} carries no media")
    rules.check_resolved_canvas(spec.height, spec.width, geometry)
    rules.check_num_frames(spec.num_frames)
    workflow.check_items(list(spec.items))
    for index, item in enumerate(spec.items):
        check_id(f"items[{index}].asset_id", item.asset_id)
    total = sum(item.bytes for item in spec.items)
    if total > max_input_bytes:
        raise InvalidRequest(
            "items",
            f"{total} bytes of assets, over the {max_input_bytes} bytes a request may carry here (max_input_bytes)",
        )


def check_dtype(name: str, tensor: torch.Tensor, *dtypes: torch.dtype) -> None:
    if tensor.dtype not in dtypes:
        raise InvalidRequest(name, f"dtype {tensor.dtype}, expected {' or '.join(map(str, dtypes))}")
