"""``cachepilot experiment seed-claims``: every claim of the original study re-measured
across seeds on the simulator (:mod:`.runs`: the fixed setup and the runs; :mod:`.claims`:
each claim judged from them; :mod:`.report` and :mod:`.plots`: the folder it writes)."""

from cachepilot.lab.seed_claims.claims import Claim, build_claims
from cachepilot.lab.seed_claims.report import write_outputs
from cachepilot.lab.seed_claims.runs import WORKLOADS, Variant, plan, run_all, run_task

__all__ = ["WORKLOADS", "Claim", "Variant", "build_claims", "plan", "run_all", "run_task",
           "write_outputs"]
