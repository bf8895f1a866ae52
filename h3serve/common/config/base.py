"""What every section of a deployment file shares: the frozen, strict `Section` base, the field types several
sections use, and the limits the gateway and a service both hold to (one definition, the default of both)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from h3serve.model import rules
from h3serve.model.workflows import names as workflow_names

# Phases the watchdog times: the stage call starts a phase; each progress event restarts its clock.
STALL_DEFAULTS = {"encode": 300.0, "denoise": 900.0, "decode": 600.0, "mux": 300.0}
# How long a job waits for a stage with no replica that can take its call (down, restarting, loading
# weights) before it fails UNAVAILABLE: a DiT group restart reloads the transformer, so the DiT waits longest.
OUTAGE_DEFAULTS = {"encoder": 300.0, "vae-encode": 300.0, "dit": 900.0, "vae": 300.0}
DAY_S = 24 * 3600.0

# Limits both the gateway and a service hold to: one definition, the default of both sections; a deployment whose
# gateway admits more than its service takes is refused (`_gateway_within_services`)
MAX_PROMPT_CHARS = 8192
MAX_STEPS = 200
DEFAULT_STEPS = 50
MAX_ROWS = 200_000

Port = Annotated[int, Field(ge=0, le=65535)]
# [gateway] open_without_token: a part of the public API that may answer without a token, to all or on loopback
OpenPart = Literal["docs", "reflection", "metrics", "docs@loopback", "reflection@loopback", "metrics@loopback"]
Steps = Annotated[int, Field(ge=rules.MIN_STEPS)]  # num_inference_steps: N steps are N-1 transformer forwards
DType = Literal["float32", "bfloat16", "float16"]  # h3serve.runtime.models.DTYPES (which imports torch)
if TYPE_CHECKING:  # Literals built from values at run time, which a type checker cannot read: their value type
    Phase = str
    StageName = str
    Workflows = tuple[str, ...]
else:
    Phase = Literal[tuple(STALL_DEFAULTS)]
    StageName = Literal[tuple(OUTAGE_DEFAULTS)]
    # TOML: a list
    Workflows = Annotated[tuple[Literal[tuple(workflow_names())], ...], Field(min_length=1, strict=False)]


SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)")


def parse_shape(shape: str) -> tuple[int, int, int]:
    """ "HxWxF" as (height, width, frames); ValueError otherwise."""
    match = SHAPE.fullmatch(shape)
    if not match:
        raise ValueError(f'a shape is "HEIGHTxWIDTHxFRAMES", e.g. "480x832x124", got {shape!r}')
    height, width, frames = (int(part) for part in match.groups())
    return height, width, frames


class Section(BaseModel):
    """A frozen, checked section: unknown keys are refused, and a value must already have its type (strict: the
    string "8" is not the integer 8, 1 is not true), as TOML gives it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True, protected_namespaces=())

    def replace(self, /, **changes) -> Self:
        """A copy with `changes`, checked like the original (dataclasses.replace for these models)."""
        return type(self)(**{**dict(self), **changes})

    @field_validator("tls_key", check_fields=False)
    @classmethod
    def _tls_pair(cls, key: str, info: ValidationInfo) -> str:
        # info.data holds the fields declared before this one that passed
        if "tls_cert" in info.data and bool(key) != bool(info.data["tls_cert"]):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        return key
