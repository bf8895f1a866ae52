"""One logging set-up for every h3serve process: `time level service message` on stderr."""

from __future__ import annotations

import logging
import os
import warnings


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
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
