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
import functools
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


DRIVER_NODE = "/dev/nvidiactl"  # where an NVIDIA driver is loaded: a host worth probing


def _probe() -> subprocess.Popen | None:
    """Start reading each visible GPU's compute capability in a process of its own (the driver starts there, not
    here) at once: its interpreter, torch import and driver start take seconds, spent while this one imports."""
    if not os.path.exists(DRIVER_NODE):
        return None
    return subprocess.Popen(
        [sys.executable, "-c", CAPABILITIES], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )


def _capabilities(probe: subprocess.Popen) -> list[tuple[int, int]]:
    try:
        out, _ = probe.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        probe.kill()
        probe.communicate()
        return []
    lines = out.strip().splitlines()
    return [tuple(each) for each in ast.literal_eval(lines[-1])] if probe.returncode == 0 and lines else []


@contextlib.contextmanager
def _capabilities_without_the_driver(probe: subprocess.Popen | None) -> Iterator[None]:
    """torch.cuda.get_device_capability answered from the probe, which is waited for at the first question (an
    import's), not before the imports; without an answer the question goes to torch (which starts the driver)."""
    import torch

    if probe is None or not torch.cuda.is_available():
        if probe is not None:
            probe.kill()  # a driver, but no GPU this process may use
            probe.wait()
        yield
        return
    asked, known = torch.cuda.get_device_capability, functools.cache(lambda: _capabilities(probe))

    def answer(device=None) -> tuple[int, int]:
        if not known():
            return asked(device)
        index = device if isinstance(device, int) else getattr(torch.device(device or "cuda"), "index", None)
        return known()[index or 0]

    torch.cuda.get_device_capability = answer
    try:
        yield
    finally:
        torch.cuda.get_device_capability = asked
        known()  # the probe reaped, asked or not


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
    probe = _probe()  # before torch's import, which it overlaps
    with _no_device_detection(), _capabilities_without_the_driver(probe):
        for name in MODULES:
            with contextlib.suppress(Exception):
                __import__(name)
