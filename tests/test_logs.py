"""h3serve/common/logs.py: a service's log opens without the libraries' known start-up notices (torchao's pytree
deprecations, diffusers' "Unable to import `torchao` Tensor objects", torch's weight_norm deprecation), while a
genuine warning or warning record still reaches it. A real process, importing in a service's order."""

from __future__ import annotations

import subprocess
import sys

# A service module imports the logging set-up, then (through diffusers) torchao, and only then, in serve(), calls
# setup(); then it loads the model (the audio VAE builds weight_norm layers).
SERVICE_START = """
import logging, warnings
import torch
from h3serve.common import logs
from diffusers import AutoencoderKL
import pytest

pytestmark = pytest.mark.processes
logs.setup("vae")
torch.nn.utils.weight_norm(torch.nn.Linear(2, 2))
warnings.warn("a genuine warning", UserWarning)
warnings.warn("a genuine deprecation", FutureWarning)
logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass and is now natively supported by "
                                                 "torch.compile", logging.Logger)
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").critical("a genuine diffusers record")
"""
KNOWN_NOTICES = (
    "Unable to import `torchao` Tensor objects",
    "KernelPreference",
    "ScaleCalculationMode",
    "weight_norm` is deprecated",
)


def test_a_service_log_has_no_known_notices_and_every_genuine_warning():
    stderr = subprocess.run(
        [sys.executable, "-c", SERVICE_START], capture_output=True, text=True, check=True, timeout=240
    ).stderr
    assert [notice for notice in KNOWN_NOTICES if notice in stderr] == [], stderr
    for genuine in (
        "UserWarning: a genuine warning",
        "FutureWarning: a genuine deprecation",
        "<class 'logging.Logger'> is an Enum subclass",
        "a genuine diffusers record",
    ):
        assert genuine in stderr, f"{genuine!r} missing:\n{stderr}"
