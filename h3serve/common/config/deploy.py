"""The whole deployment file: its sections, in the order a file lists them, and the model that checks each."""

from __future__ import annotations

from pydantic import Field

from h3serve.common.config.base import Section
from h3serve.common.config.dit import DiTConfig
from h3serve.common.config.gateway import GatewayConfig
from h3serve.common.config.model import ModelSection
from h3serve.common.config.services import EncoderConfig, VaeConfig
from h3serve.common.config.supervisor import SupervisorConfig


class DeployConfig(Section):
    encoder: EncoderConfig = Field(default_factory=lambda: EncoderConfig(port=50051))
    dit: DiTConfig = Field(default_factory=lambda: DiTConfig(port=50052))
    vae: VaeConfig = Field(default_factory=lambda: VaeConfig(port=50053))
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)

    def service(self, name: str):
        return getattr(self, name)


SERVICES = ("encoder", "dit", "vae")
# A `host` that listens on every interface: a client on the same machine reaches it on loopback.
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
SECTIONS = ("model", *SERVICES, "gateway", "supervisor")
SECTION_MODELS: dict[str, type[Section]] = {
    "model": ModelSection,
    "encoder": EncoderConfig,
    "dit": DiTConfig,
    "vae": VaeConfig,
    "gateway": GatewayConfig,
    "supervisor": SupervisorConfig,
}
