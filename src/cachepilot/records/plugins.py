"""The lifecycle plugins every driver runs, built in one place.

The gateway and the simulator call :func:`lifecycle_plugins` with what they have (a decision
log, a replica name, whether to learn) and hand the result to their Router, so both drivers
record, learn and share state through the same plugins in the same order; the gateway adds
its own (metrics, stall tracking) as ``extra``. Why the order matters: the predictor must see
a decision before anything that could end it, and recording comes after the core's plugins
so a record shows the decision as they left it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cachepilot.core.decision import Decision
from cachepilot.core.lifecycle import Outcome, Plugin
from cachepilot.core.pool import Pool
from cachepilot.core.predictor import TTFTPredictor
from cachepilot.core.sync import ReplicaSync


class DecisionSink(Protocol):
    """Where decisions and outcomes go: a :class:`~cachepilot.records.Recorder`, or a test's
    list."""

    def decision(self, decision: Decision, pool: Pool | None = None, *,
                 prompt: str | None = None) -> object: ...

    def outcome(self, decision_id: str, outcome: Outcome) -> object: ...


class RecordingPlugin(Plugin):
    """Every routed decision into the decision log, then how it ended. The prompt's text
    only with ``capture_prompts`` (records are hashes by default)."""

    def __init__(self, sink: DecisionSink, *, capture_prompts: bool = False) -> None:
        self.sink = sink
        self.capture_prompts = capture_prompts

    def on_routed(self, decision: Decision, pool: Pool) -> None:
        req = decision.request
        prompt = req.prompt if self.capture_prompts and req is not None else None
        self.sink.decision(decision, pool, prompt=prompt)

    def on_finish(self, decision: Decision, outcome: Outcome) -> None:
        if outcome.observed:  # nothing is known of an unobserved end: record nothing
            self.sink.outcome(decision.id, outcome)


@dataclass(frozen=True, slots=True)
class Lifecycle:
    """What :func:`lifecycle_plugins` built: the plugins in order, and the parts a driver
    reads back (the predictor's accuracy, the replica sync's outbox)."""

    plugins: tuple[Plugin, ...]
    predictor: TTFTPredictor | None = None
    sync: ReplicaSync | None = None


def lifecycle_plugins(*, learn: bool = True, replica: str | None = None,
                      sink: DecisionSink | None = None, capture_prompts: bool = False,
                      extra: Sequence[Plugin] = ()) -> Lifecycle:
    """The plugins of one router: the TTFT predictor (``learn``), replica sync (``replica``
    names this replica on the bus), recording (``sink``), then ``extra``."""
    predictor = TTFTPredictor() if learn else None
    sync = ReplicaSync(replica) if replica is not None else None
    recording = (RecordingPlugin(sink, capture_prompts=capture_prompts)
                 if sink is not None else None)
    plugins = tuple(p for p in (predictor, sync, recording) if p is not None) + tuple(extra)
    return Lifecycle(plugins, predictor, sync)
