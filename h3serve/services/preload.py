"""What the fork server runs before its first fork (`preload`), and the modules it imports once for every model
process it starts (h3serve/common/forkserver.py): each
service's modules and, ahead of them, what the services import only when they load (the diffusers and transformers
classes of the model, the encoder's processor, LoRA and quantisation). A name missing here only costs its import in
each child; an entry module (`h3serve.cli`'s `__main__`, `h3serve.services.dit.rank`) is never listed: the child
runs it as `python -m` would, and a copy imported earlier would be a second module.

No fork could use a GPU whose driver its parent initialised, and some of these imports ask about the GPU: torchao
(through diffusers' quantizers) asks whether Triton can run, which reads the device's properties, and for the
compute capability. While importing, the server answers them without the driver: torch.cuda.is_available() and
device_count() through NVML, the capabilities as a short-lived process read them, Triton's device check switched
off; afterwards Triton's cached answer is dropped, so each child asks its own GPU. An import that still starts the
driver makes the server refuse every fork (the children then start as plain processes).
"""

import ast
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

MODULES = [
    "torch",
    "torch._dynamo",
    "diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3",
    "diffusers.models.transformers.transformer_minimax_h3",
    "diffusers.models.autoencoders.autoencoder_kl_minimax_h3",
    "diffusers.loaders.lora_pipeline",
    "diffusers.hooks.group_offloading",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen3_vl.processing_qwen3_vl",
    "transformers.models.qwen3_vl.video_processing_qwen3_vl",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "peft.tuners.lora",
    "torchao.quantization",
    "av",
    "h3serve.cli.main",
    "h3serve.services.encoder.server",
    "h3serve.services.vae.server",
    "h3serve.services.dit.server",
    "h3serve.services.dit.runner",
    "h3serve.services.dit.parallel",
    "h3serve.services.dit.adapters",
    "h3serve.services.dit.config_check",
    "h3serve.services.dit.group",
    "h3serve.services.dit.warmup",
]


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
CAPABILITIES = "import torch; print([torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())])"


def _capabilities() -> list[tuple[int, int]]:
    """Each visible GPU's compute capability, read by a process of its own (the driver starts there, not here)."""
    found = subprocess.run([sys.executable, "-c", CAPABILITIES], capture_output=True, text=True, timeout=300)
    lines = found.stdout.strip().splitlines()
    return [tuple(each) for each in ast.literal_eval(lines[-1])] if found.returncode == 0 and lines else []


@contextlib.contextmanager
def _capabilities_without_the_driver() -> Iterator[None]:
    import torch

    capabilities = _capabilities() if torch.cuda.is_available() else []
    if not capabilities:
        yield
        return
    asked = torch.cuda.get_device_capability

    def answer(device=None) -> tuple[int, int]:
        index = device if isinstance(device, int) else getattr(torch.device(device or "cuda"), "index", None)
        return capabilities[index or 0]

    torch.cuda.get_device_capability = answer
    try:
        yield
    finally:
        torch.cuda.get_device_capability = asked


@contextlib.contextmanager
def _no_device_detection() -> Iterator[None]:
    nvml_set = NVML_CHECK in os.environ
    os.environ.setdefault(NVML_CHECK, "1")
    import torch._inductor.config as inductor
    from torch.utils._triton import has_triton

    # torch without the switch: a child's GPU stays usable only if no import asks (the server refuses forks if one
    # did, h3serve/common/forkserver.py)
    detection = getattr(inductor, "triton_disable_device_detection", None)
    if detection is not None:
        inductor.triton_disable_device_detection = True
    try:
        yield
    finally:
        if detection is not None:
            inductor.triton_disable_device_detection = detection
        has_triton.cache_clear()
        if not nvml_set:
            del os.environ[NVML_CHECK]


def preload() -> None:
    """Import MODULES; one that fails to import is left to the child, which reports it as a plain start would."""
    with _no_device_detection(), _capabilities_without_the_driver():
        for name in MODULES:
            with contextlib.suppress(Exception):
                __import__(name)
