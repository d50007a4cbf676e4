"""How often recent prompts held each KV block: what losing that block would cost later.

A slot engine (llama.cpp) keeps one prompt per slot, so every placement overwrites a slot's
prompt. Overwriting a one-off question costs nothing; overwriting the last copy of a
document that the next requests share costs each of them its prefill again, and the miss
chains (that request overwrites another worker's hot document). The directory counts, per
block, the placed prompts that held it, decayed over a half-life of placements: a logical
clock, so the core needs no time source and the simulator and the gateway count alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

_LN2 = math.log(2.0)


@dataclass
class BlockPopularity:
    half_life: float = 16.0  # placements
    max_blocks: int = 200_000  # above this, blocks whose count has decayed away are dropped
    tick: int = 0
    _counts: dict[int, tuple[float, int]] = field(default_factory=dict)  # hash → (count, at)

    def note(self, hashes: Iterable[int]) -> None:
        """One placed prompt held these blocks."""
        self.tick += 1
        tick, counts, decay = self.tick, self._counts, _LN2 / self.half_life
        for h in hashes:
            c, at = counts.get(h, (0.0, tick))
            counts[h] = (c * math.exp(-decay * (tick - at)) + 1.0, tick)
        if len(counts) > self.max_blocks:
            self._prune()

    def count(self, h: int) -> float:
        c, at = self._counts.get(h, (0.0, self.tick))
        return c * math.exp(-_LN2 / self.half_life * (self.tick - at))

    def reuse_probability(self, h: int, horizon: float) -> float:
        """The chance that another prompt needs block ``h`` within ``horizon`` placements,
        from its recent rate: the decayed count over the decayed number of placements seen
        (a count of one per placement would reach it), the holder's own placement not
        being a reuse (hence ``- 1``)."""
        decay = math.exp(-_LN2 / self.half_life)
        seen = (1.0 - decay ** self.tick) / (1.0 - decay)
        rate = max(0.0, self.count(h) - 1.0) / seen if seen > 0 else 0.0
        return 1.0 - math.exp(-rate * horizon)

    def _prune(self) -> None:
        tick, decay = self.tick, _LN2 / self.half_life
        self._counts = {h: (c, at) for h, (c, at) in self._counts.items()
                        if c * math.exp(-decay * (tick - at)) >= 0.05}
