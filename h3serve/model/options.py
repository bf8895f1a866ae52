"""The request options, declared once: each field of GenerationParams with the name each door gives it, what it
means and its default when unset. The doors are made from this table: the `generate` and `reference` flags
(h3serve/cli/request_flags.py), the HTTP create body (h3serve/gateway/http/videos.py); the gateway resolves and
checks them (h3serve/gateway/admission/request.py, h3serve/model/adapters.py). A new option is its proto field, a
row here, the stage that reads it and a test; each option's type comes from its proto field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor

from h3serve.model import adapters
from h3serve.model.rules import MIN_STEPS, InvalidRequest
from h3serve.v1 import common_pb2

FIELDS = common_pb2.GenerationParams.DESCRIPTOR.fields_by_name
PYTHON_TYPES = {
    FieldDescriptor.CPPTYPE_INT32: int,
    FieldDescriptor.CPPTYPE_UINT64: int,
    FieldDescriptor.CPPTYPE_DOUBLE: float,
    FieldDescriptor.CPPTYPE_BOOL: bool,
}
# What the wire carries of each integer type (a field without presence reads 0 as unset, so never below 0).
WIRE_BOUNDS = {FieldDescriptor.CPPTYPE_INT32: (0, 2**31 - 1), FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1)}


@dataclass(frozen=True)
class Option:
    """One GenerationParams field as the doors offer it."""

    name: str  # the GenerationParams field
    help: str  # what it is and what an unset value becomes
    http_name: str = ""  # the HTTP create body's field, when not `name`
    flag_name: str = ""  # the CLI's flag, when not --name (dashes for underscores)
    cli: bool = True  # False: no flag of its own (include_raw: `generate --raw FILE` asks for it)

    @property
    def field(self) -> FieldDescriptor:
        return FIELDS[self.name]

    @property
    def repeated(self) -> bool:
        return self.field.is_repeated

    @property
    def type(self) -> type:
        """The Python type of one value (Adapter for adapters)."""
        if self.field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            return common_pb2.Adapter
        return PYTHON_TYPES[self.field.cpp_type]

    @property
    def wire_bounds(self) -> tuple[int, int] | None:
        """The integers the field can carry, None for other types; the model's own bounds are checked later."""
        return WIRE_BOUNDS.get(self.field.cpp_type)

    @property
    def http(self) -> str:
        return self.http_name or self.name

    @property
    def flag(self) -> str:
        return self.flag_name or "--" + self.name.replace("_", "-")


def _shift(which: str, key: str) -> str:
    return (
        f"the {which} schedule's sigma shift, 0 < shift <= {adapters.MAX_SHIFT:g} (unset: an adapter's "
        f"recommendation, else {adapters.DEFAULT_SHIFTS[key]:g}, the released model's)"
    )


OPTIONS = (
    Option(
        "num_inference_steps",
        f"num_inference_steps: N steps are N-1 transformer forwards, at least {MIN_STEPS} (unset: an adapter's "
        "recommendation, else the deployment's default_steps)",
        http_name="steps",
        flag_name="--steps",
    ),
    Option("seed", "seeds all the noise of the clip (unset: drawn by the gateway, reported in the job)"),
    Option("include_raw", "also keep the decoded frames and waveform as an .npz artifact", cli=False),
    Option(
        "adapters",
        f"a LoRA adapter of the DiT's [dit] adapters as NAME[:WEIGHT], weight 1 by default, |weight| <= "
        f"{adapters.MAX_WEIGHT:g} (repeatable, in order)",
        flag_name="--adapter",
    ),
    Option("flow_shift", _shift("video", "flow_shift")),
    Option("audio_flow_shift", _shift("audio", "audio_flow_shift")),
)
BY_NAME = {option.name: option for option in OPTIONS}


def params(values: dict[str, object]) -> common_pb2.GenerationParams:
    """GenerationParams with each option in `values` (by name) that is given; None and empty lists stay unset."""
    made = common_pb2.GenerationParams()
    for name, value in values.items():
        if value is None:
            continue
        if BY_NAME[name].repeated:
            getattr(made, name).extend(value if isinstance(value, Iterable) else [value])
        else:
            setattr(made, name, value)
    return made


# GenerateRequest's and ResolvedRequest's top-level fields from before GenerationParams (deprecated: still honoured,
# and still written for readers of the old fields); each is the params field of the same name. Folded here only.
LEGACY = ("num_inference_steps", "seed", "include_raw")


def folded(request) -> common_pb2.GenerationParams:
    """A GenerateRequest's params with its deprecated top-level copies folded in; InvalidRequest names a field set
    in both places to different values."""
    made = common_pb2.GenerationParams()
    made.CopyFrom(request.params)
    for name in LEGACY:
        if not _is_set(request, name):
            continue
        if _is_set(made, name) and getattr(made, name) != getattr(request, name):
            raise InvalidRequest(
                name,
                f"set at the top level ({getattr(request, name)}) and in params "
                f"({getattr(made, name)}); set params.{name} only",
            )
        setattr(made, name, getattr(request, name))
    return made


def write_legacy(resolved) -> None:
    """A ResolvedRequest's deprecated top-level fields, copied from its resolved params for their old readers."""
    for name in LEGACY:
        setattr(resolved, name, getattr(resolved.params, name))


def _is_set(message, name: str) -> bool:
    """Set by the client: present for fields with presence, non-zero for the others."""
    if message.DESCRIPTOR.fields_by_name[name].has_presence:
        return message.HasField(name)
    return bool(getattr(message, name))
