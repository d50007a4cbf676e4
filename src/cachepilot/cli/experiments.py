"""``cachepilot experiment``: the studies (:mod:`cachepilot.lab`), each imported only when
its command runs; simulator studies (seed-claims, peers, replicas, flow:
:mod:`cachepilot.cli.experiments_sim`) and real-worker studies (real-model on llama.cpp or
vLLM, real-peers: :mod:`cachepilot.cli.experiments_real`)."""

from __future__ import annotations

import click

from cachepilot.cli.experiments_real import real_model_cmd, real_peers_cmd
from cachepilot.cli.experiments_real import seed_list as seed_list  # re-exported
from cachepilot.cli.experiments_sim import flow_cmd, peers_cmd, replicas_cmd, seed_claims_cmd


@click.group("experiment")
def experiment_group() -> None:
    """Studies: the simulator's (seed-claims, peers, replicas) and real workers'
    (real-model, real-peers)."""


for _command in (seed_claims_cmd, replicas_cmd, peers_cmd, flow_cmd, real_peers_cmd,
                 real_model_cmd):
    experiment_group.add_command(_command)
