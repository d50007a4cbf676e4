"""Envoy's bootstrap, generated: one :func:`render` for both protocols.

* :mod:`.ours`: Envoy in front of CachePilot's own ext_proc protocol (body-only routing, the
  observing filter, JSON local replies); :class:`EnvoyOptions`.
* :mod:`.epp`: Envoy in front of any endpoint picker, as the Gateway API Inference
  Extension's reference gateway configures it; :class:`EppEnvoyOptions`.
* :mod:`.common`: the clusters, filters, routes and listener both are built from.

The options' type picks the bootstrap, so a caller (``cachepilot envoy-config``, the local
stacks, the chart's generated file, the conformance suite) has one function to call.
"""

from __future__ import annotations

from typing import Any

import orjson
import yaml

from cachepilot.deploy.envoy import epp, ours
from cachepilot.deploy.envoy.common import override_host_cluster
from cachepilot.deploy.envoy.epp import EppEnvoyOptions
from cachepilot.deploy.envoy.ours import EnvoyOptions

Options = EnvoyOptions | EppEnvoyOptions


def bootstrap(o: Options) -> dict[str, Any]:
    """The whole bootstrap as a dict: ours for :class:`EnvoyOptions`, the endpoint picker's
    for :class:`EppEnvoyOptions`."""
    return epp.build(o) if isinstance(o, EppEnvoyOptions) else ours.build(o)


def render(o: Options, fmt: str = "yaml") -> str:
    """The bootstrap as YAML (keys in the order built) or indented JSON."""
    config = bootstrap(o)
    if fmt == "json":
        return orjson.dumps(config, option=orjson.OPT_INDENT_2).decode()
    return yaml.safe_dump(config, sort_keys=False)


__all__ = ["EnvoyOptions", "EppEnvoyOptions", "Options", "bootstrap", "override_host_cluster",
           "render"]
