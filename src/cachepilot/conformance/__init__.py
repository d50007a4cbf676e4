"""A black-box conformance suite for Gateway API Inference Extension endpoint pickers (EPPs):
a real Envoy configured as the reference gateway configures an EPP, fake workers at known
addresses, a direct ext_proc client for what Envoy cannot produce on demand, and one check
per rule, each rule classed (protocol: required; reference: recommended; extension:
CachePilot's) and cited. Run it against any EPP address:
``python -m cachepilot.conformance --epp HOST:PORT --profile epp-core --report FILE``
(docs/epp.md)."""

from cachepilot.conformance.rules import Rule, SuiteConfig
from cachepilot.conformance.run import Report, Result, catalog, run_suite

__all__ = ["Report", "Result", "Rule", "SuiteConfig", "catalog", "run_suite"]
