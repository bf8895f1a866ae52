"""How soon a full queue frees a place: the retry time a queue-full refusal advises.

Little's law: with N jobs in the gateway (queued or running) that each stay W seconds on average, one leaves about
every W / N seconds. W is the mean of the last WINDOW jobs' times from their start in this gateway to their end
(queue waits included: every unfinished job counts towards the bound). The k-th place frees after about
k * W / N seconds, k = depth - bound + 1 (1 at the bound). Before any job has ended there is nothing to go by:
DEFAULT_WAIT_S. The advice is clamped to [MIN_WAIT_S, MAX_WAIT_S] and given in whole seconds (Retry-After's unit).
"""

from __future__ import annotations

import math
from collections import deque
from statistics import fmean

WINDOW = 32
DEFAULT_WAIT_S = 5
MIN_WAIT_S = 1
MAX_WAIT_S = 600


class DrainEstimate:
    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=WINDOW)

    def ended(self, seconds: float) -> None:
        """A job ended (any way) after `seconds` in the gateway."""
        self._seconds.append(seconds)

    def wait_s(self, depth: int, bound: int) -> int:
        """Seconds until a place frees in a queue of `depth` unfinished jobs bounded at `bound`."""
        if not self._seconds or depth <= 0:
            return DEFAULT_WAIT_S
        places = max(depth - bound + 1, 1)
        wait = places * fmean(self._seconds) / depth
        return min(max(math.ceil(wait), MIN_WAIT_S), MAX_WAIT_S)
