"""Typed configuration for every h3serve process, read from one TOML deployment file.

Each section ([model], [encoder], [dit], [vae], [gateway], [supervisor]) maps onto a frozen pydantic model, one
module per section or group of sections; command-line flags override single fields. `[model] dir` points every model
service at a local diffusers model directory; empty means the built-in tiny preset. Every value is checked by type
and range when the file is read, so a bad deployment fails at start with one line per problem naming the file,
section and key. Every public name is importable from here, `h3serve.common.config`.
"""

from h3serve.common.config.base import (
    DAY_S,
    DEFAULT_STEPS,
    MAX_PROMPT_CHARS,
    MAX_ROWS,
    MAX_STEPS,
    OUTAGE_DEFAULTS,
    SHAPE,
    STALL_DEFAULTS,
    DType,
    OpenPart,
    Phase,
    Port,
    Section,
    StageName,
    Steps,
    Workflows,
    parse_shape,
)
from h3serve.common.config.deploy import SECTION_MODELS, SECTIONS, SERVICES, WILDCARD_HOSTS, DeployConfig
from h3serve.common.config.dit import FILE_FORMATS, FILE_PARTITION, FLOAT16_REFUSED, GGUF, SAFETENSORS, DiTConfig
from h3serve.common.config.gateway import MESSAGE_ENVELOPE_BYTES, Addresses, GatewayConfig
from h3serve.common.config.loading import SHARED_LIMITS, ConfigError, load_deploy, override
from h3serve.common.config.model import Adapter, AdapterName, AdapterSource, ModelSection
from h3serve.common.config.services import CompiledServiceConfig, EncoderConfig, ModelServiceConfig, VaeConfig
from h3serve.common.config.supervisor import SupervisorConfig

__all__ = [
    "DAY_S",
    "DEFAULT_STEPS",
    "FILE_FORMATS",
    "FILE_PARTITION",
    "FLOAT16_REFUSED",
    "GGUF",
    "MAX_PROMPT_CHARS",
    "MAX_ROWS",
    "MAX_STEPS",
    "MESSAGE_ENVELOPE_BYTES",
    "OUTAGE_DEFAULTS",
    "SAFETENSORS",
    "SECTIONS",
    "SECTION_MODELS",
    "SERVICES",
    "SHAPE",
    "SHARED_LIMITS",
    "STALL_DEFAULTS",
    "WILDCARD_HOSTS",
    "Adapter",
    "AdapterName",
    "AdapterSource",
    "Addresses",
    "CompiledServiceConfig",
    "ConfigError",
    "DType",
    "DeployConfig",
    "DiTConfig",
    "EncoderConfig",
    "GatewayConfig",
    "ModelSection",
    "ModelServiceConfig",
    "OpenPart",
    "Phase",
    "Port",
    "Section",
    "StageName",
    "Steps",
    "SupervisorConfig",
    "VaeConfig",
    "Workflows",
    "load_deploy",
    "override",
    "parse_shape",
]
