"""When each job of an open-loop experiment is submitted: seconds from the start. A closed loop has no schedule: a
job starts when one ends (driver.Driver)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from h3serve.experiment.loadspec import Arrivals, read_trace


def poisson(rate: float, seed: int) -> Iterator[float]:
    """A Poisson process: exponential gaps of mean 1/rate, from a generator of its own (same seed, same times)."""
    rng = np.random.default_rng([seed, 0])
    return itertools.accumulate(rng.exponential(1.0 / rate) for _ in itertools.count())


def schedule(arrivals: Arrivals, seed: int) -> Iterator[float] | None:
    """The open-loop arrival times (unbounded for Poisson: the bounds stop it), or None for a closed loop."""
    if arrivals.process == "poisson":
        assert arrivals.rate is not None  # Arrivals refuses a poisson process without one
        return poisson(arrivals.rate, seed)
    if arrivals.process == "trace":
        return iter(read_trace(arrivals.trace))
    return None
