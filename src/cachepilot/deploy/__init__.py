"""Generated deployables: what runs beside the code rather than in it.

* :mod:`.envoy`: Envoy's bootstrap for both protocols (ours and the endpoint picker's), used
  by ``cachepilot envoy-config``, the local stacks, the conformance suite and the files below;
* :mod:`.generate`: writes (``--write``) or checks (``--check``) every file in the repository
  generated from code: the CRD (chart, ``manifests/``, ``operator/``), the operator's RBAC
  (``operator/rbac.yaml``, rendered from the chart), the Envoy bootstraps (chart,
  ``extproc/``).

Layer: above the drivers (gateway, operator, sim), whose header names and CRD schema it reads,
below the tooling that starts Envoy with it; nothing at run time in a pod imports it.
"""
