"""The ``cachepilot`` command. Every click command lives in this package (one module per
area); the modules below it (tooling, sim, gateway, …) are plain functions. A subcommand's
module is imported only when used, so ``cachepilot sim-worker`` does not pay for gRPC or
kopf imports."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

# name → "module:attribute" of a click command. Add a line here for a new subcommand.
COMMANDS: dict[str, str] = {
    "sim-worker": "cachepilot.cli.worker:sim_worker_cmd",
    "gateway": "cachepilot.cli.gateway:gateway_cmd",
    "envoy-config": "cachepilot.cli.gateway:envoy_config_cmd",
    "up": "cachepilot.cli.stack:up_cmd",
    "demo": "cachepilot.cli.demo:demo_cmd",
    "simulate": "cachepilot.cli.sim:simulate_cmd",
    "experiment": "cachepilot.cli.experiments:experiment_group",
    "explain": "cachepilot.cli.records:explain_cmd",
    "replay": "cachepilot.cli.records:replay_cmd",
    "decisions": "cachepilot.cli.records:decisions_group",
}


class LazyGroup(click.Group):
    """A group whose ``lazy`` subcommands ("module:attribute") are imported when invoked."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = self.lazy.get(name)
        if target is None:
            return super().get_command(ctx, name)
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.version_option(package_name="cachepilot")
def main() -> None:
    """CachePilot: route LLM requests to the worker that holds their prefix, priced in ms."""
