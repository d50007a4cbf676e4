"""A black-box conformance suite for Gateway API Inference Extension endpoint pickers (EPPs):
a real Envoy configured as the reference gateway configures an EPP, fake workers at known
addresses, and one check per protocol rule. Run it against any EPP address:
``python -m cachepilot.conformance --epp HOST:PORT`` (docs/epp.md)."""

from cachepilot.conformance.suite import RULES, Report, Result, Rule, SuiteConfig, run_suite

__all__ = ["RULES", "Report", "Result", "Rule", "SuiteConfig", "run_suite"]
