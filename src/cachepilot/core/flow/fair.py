"""Virtual counters of service: each (band, tenant)'s weighted tokens, decayed lazily.

VTC's counter (Sheng et al., OSDI'24; ``slora/server/router/vtc_req_queue.py``) with two
changes a gateway needs: the charge is made at dispatch from an estimate of the output (the
gateway does not see tokens as they are generated) and corrected when the worker reports the
real count; and counters decay with a half-life (as llm-d's least-attained-service policy
does), so a tenant is not owed service for an idle hour. Decay multiplies every counter by
the same factor, so it keeps their order.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable


class Counters:
    """Weighted tokens served per key, with a half-life (0: no decay)."""

    def __init__(self, half_life_s: float = 0.0) -> None:
        self.half_life_s = half_life_s
        self._v: dict[Hashable, tuple[float, float]] = {}  # key → (value, as of)

    def value(self, key: Hashable, now: float) -> float:
        v = self._v.get(key)
        if v is None:
            return 0.0
        value, at = v
        if self.half_life_s <= 0 or now <= at:
            return value
        return value * math.exp2(-(now - at) / self.half_life_s)

    def charge(self, key: Hashable, amount: float, now: float) -> float:
        """Add ``amount`` (negative: a correction); returns the new value, never below 0."""
        value = max(0.0, self.value(key, now) + amount)
        self._v[key] = (value, now)
        return value

    def serve(self, key: Hashable, floor: float, amount: float, now: float) -> float:
        """Lift ``key`` to ``floor``, then charge ``amount``; returns its value before the
        charge (one decay instead of three, on every dispatch)."""
        start = max(self.value(key, now), floor)
        self._v[key] = (max(0.0, start + amount), now)
        return start

    def lift(self, key: Hashable, floor: float, now: float) -> None:
        """VTC's rule for a tenant that becomes backlogged: its counter rises to ``floor``
        (the least counter among those already backlogged), so idling earns no credit to
        spend in a burst."""
        if self.value(key, now) < floor:
            self._v[key] = (floor, now)

    def least(self, keys: Iterable[Hashable], now: float) -> float:
        return min((self.value(k, now) for k in keys), default=0.0)

    def forget(self, keep: Iterable[Hashable], now: float, below: float = 1.0) -> None:
        """Drop counters that decayed under ``below`` (bounded memory over many tenants),
        except ``keep``."""
        kept = set(keep)
        for k in [k for k in self._v if k not in kept and self.value(k, now) < below]:
            del self._v[k]

    def __len__(self) -> int:
        return len(self._v)


class OutputEstimate:
    """Output tokens to charge at dispatch: the request's ``max_tokens`` capped by its
    tenant's recent completions (an EWMA), or the default when neither is known."""

    ALPHA = 0.1  # the EWMA's weight on the newest completion (~10 requests of memory)

    def __init__(self, default: int) -> None:
        self.default = default
        self._mean: dict[str, float] = {}

    def estimate(self, tenant: str, max_tokens: int | None) -> int:
        mean = self._mean.get(tenant)
        if mean is None:
            return max_tokens if max_tokens is not None else self.default
        guess = max(1, round(2.0 * mean))  # above the mean: undercharging favours the flood
        return guess if max_tokens is None else min(max_tokens, guess)

    def observe(self, tenant: str, completion_tokens: int) -> None:
        mean = self._mean.get(tenant)
        self._mean[tenant] = (float(completion_tokens) if mean is None
                              else mean + self.ALPHA * (completion_tokens - mean))
        if len(self._mean) > 10_000:  # many short-lived tenants: keep memory bounded
            self._mean.pop(next(iter(self._mean)))
