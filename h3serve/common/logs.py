"""One logging set-up for every h3serve process: `time level service message` on stderr."""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownNotice(logging.Filter):
    """Drops the records of one logger whose message template starts with `message` and, when `arg_module` is set,
    whose first argument comes from that package: one library notice, not the logger's other records."""

    logger: str
    message: str
    arg_module: str = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.message):
            return True
        source = getattr(record.args[0], "__module__", "") if isinstance(record.args, tuple) and record.args else ""
        return not source.startswith(self.arg_module)


# Start-up notices of the libraries the model services load that read like errors but ask nothing of h3serve; every
# service log opened with them. Each is matched by its logger (or warning category and module) and its own text, so
# the same loggers' other records and every other warning still reach the log.
KNOWN_NOTICES = (
    # torchao registers its Enum types (KernelPreference, ScaleCalculationMode) as pytree constants when imported,
    # which torch 2.14 calls deprecated: torchao's call, at import, not h3serve's; only torchao's enums are dropped.
    KnownNotice(
        "torch.utils._pytree",
        "%s is an Enum subclass and is now natively supported by torch.compile",
        arg_module="torchao",
    ),
    # diffusers adds torchao's uintx / NF4 tensor classes to torch.load's allow-list and says so when this torchao no
    # longer has them; h3serve saves and loads torchao's fp8 and int8 tensors only (h3serve/runtime/quantised_store.py).
    KnownNotice("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
)


def _drop_known_notices() -> None:
    for notice in KNOWN_NOTICES:
        logging.getLogger(notice.logger).addFilter(notice)
    # diffusers' audio VAE builds its layers with torch's old weight_norm, which torch deprecates: the model's code.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.nn\.utils\.weight_norm` is deprecated",
        category=FutureWarning,
        module=r"torch\.nn\.utils\.weight_norm",
    )


# At import, not in setup(): a service module imports torchao (through diffusers) before its serve() calls setup(),
# and imports this module before that. A logger's filters stay when torch or diffusers configure it later.
_drop_known_notices()


def setup(service: str) -> None:
    logging.basicConfig(
        level=os.environ.get("H3SERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    # diffusers re-logs one error at every block nesting level and draws tqdm bars inside loops;
    # the services report errors and progress themselves.
    for noisy in ("diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    os.environ.setdefault("TQDM_DISABLE", "1")
