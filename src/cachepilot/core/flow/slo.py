"""A request's TTFT target: route to a worker the predictor says meets what is left of it
(time held counts against it), and say whether one did.

The predictor is the router's own: each candidate's ``predicted_ttft_ms`` (the cost model
with each worker's learned parameters). A request whose target no eligible worker is
predicted to meet still goes to the best worker, unless it is sheddable: then it is refused
(``slo_unmeetable``), as serving it late would only take capacity from the rest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from cachepilot.core.decision import Decision
from cachepilot.core.fingerprint import Fingerprint
from cachepilot.core.flow.classify import FlowMeta
from cachepilot.core.pool import Pool
from cachepilot.core.request import InferenceRequest
from cachepilot.core.router import Router

SLO = "slo"  # the candidate filter of a worker predicted to miss the target while one meets it


class Unmeetable(Exception):
    """No eligible worker is predicted to meet a sheddable request's target."""


def meet_slo(router: Router, pool: Pool, d: Decision, req: InferenceRequest, fp: Fingerprint,
             meta: FlowMeta, now: float, only: Collection[str] | None,
             excluded: Mapping[str, str] | None, held_ms: float) -> tuple[Decision, bool | None]:
    """The decision to book and whether its worker is predicted to meet the target (None:
    the request has none). Raises :class:`Unmeetable` for a sheddable request none meets."""
    if meta.slo_ms is None:
        return d, None
    budget = meta.slo_ms - held_ms
    if d.winner.predicted_ttft_ms <= budget:
        return d, True
    meets = {c.worker for c in d.candidates if c.eligible and c.predicted_ttft_ms <= budget}
    if meets:
        slower = {c.worker: SLO for c in d.candidates if c.eligible and c.worker not in meets}
        return router.decide(pool, req.model, fp, now, d.id, req, only=only,
                             excluded={**(excluded or {}), **slower}), True
    if meta.sheddable:
        raise Unmeetable
    return d, False
