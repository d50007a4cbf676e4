"""The ``cachepilot`` command. Each subcommand lives beside the code it drives and is imported
only when used, so ``cachepilot sim-worker`` does not pay for gRPC or kopf imports."""

from __future__ import annotations

import importlib

import click

# name → "module:attribute" of a click command. Add a line here for a new subcommand.
COMMANDS: dict[str, str] = {
    "sim-worker": "cachepilot.worker.server:sim_worker_cmd",
    "gateway": "cachepilot_extproc.cli:gateway_cmd",
    "envoy-config": "cachepilot_extproc.cli:envoy_config_cmd",
    "up": "cachepilot_extproc.stack:up_cmd",
    "demo": "cachepilot_extproc.demo:demo_cmd",
    "real-model": "cachepilot_extproc.llamacpp:real_model_cmd",  # until experiment has it
    "simulate": "cachepilot.sim.cli:simulate_cmd",
    "experiment": "cachepilot.sim.cli:experiment_group",
    "explain": "cachepilot.record.cli:explain_cmd",
    "replay": "cachepilot.record.cli:replay_cmd",
    "decisions": "cachepilot.record.cli:decisions_group",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup)
@click.version_option(package_name="cachepilot")
def main() -> None:
    """CachePilot: route LLM requests to the worker that holds their prefix, priced in ms."""
