"""Several gateway replicas in the simulator: each a Router with its own state over the same
engines, requests split between them."""

from dataclasses import replace

import pytest

from cachepilot.sim import SimConfig, Simulator, WorkloadSpec, generate
from cachepilot.sim.measures import summarize
from cachepilot.sim.simulator import SERVICE_REQUESTS_PER_CONNECTION

SPEC = WorkloadSpec("shared_prefix", rate=20.0, duration=8.0)


def run(cfg: SimConfig) -> tuple[Simulator, dict]:
    sim = Simulator(cfg)
    return sim, summarize(sim.run(generate(SPEC, 3)))


def test_every_replica_routes_and_each_keeps_its_own_state() -> None:
    sim, s = run(SimConfig(replicas=3, sharing="round_robin"))
    assert s["rejected"] == 0 and s["requests"] == len(generate(SPEC, 3))
    routed = [rep.pool.seq for rep in sim.replicas]
    assert sum(routed) == s["requests"] and max(routed) - min(routed) <= 1
    # Each directory learned only what its own replica routed.
    sizes = [rep.pool.directory.distinct_blocks() for rep in sim.replicas]
    assert len(set(sizes)) > 1 and all(n > 0 for n in sizes)


def test_one_replica_is_the_plain_simulator_and_runs_are_reproducible() -> None:
    base = SimConfig()

    def measures(s: dict) -> dict:
        return {k: v for k, v in s.items() if k not in ("wall_s", "sim_rps")}

    assert measures(run(base)[1]) == measures(run(replace(base, replicas=1,
                                                          sharing="service"))[1])
    a, b = (run(SimConfig(replicas=4, sharing="random"))[1] for _ in range(2))
    assert a["ttft_p90_s"] == b["ttft_p90_s"] and a["token_hit_rate"] == b["token_hit_rate"]


def test_service_sharing_keeps_a_client_on_one_replica_for_a_connection() -> None:
    sim, s = run(SimConfig(replicas=4, sharing="service"))
    pins = sim._client_replica  # client → (replica, requests left on its connection)
    assert pins and all(0 <= i < 4 and 0 <= left < SERVICE_REQUESTS_PER_CONNECTION
                        for i, left in pins.values())
    # A client's requests all reached its replica: fewer connections than requests.
    used = SERVICE_REQUESTS_PER_CONNECTION * len(pins) - sum(left for _, left in pins.values())
    assert used == s["requests"]
    with pytest.raises(ValueError, match="sharing"):
        Simulator(SimConfig(sharing="anycast"))
