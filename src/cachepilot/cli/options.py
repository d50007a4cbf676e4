"""Options several commands share, validated when parsed so that a mistake is one line
(``Error: …``, exit code 2) rather than a traceback from deep inside a run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from cachepilot.core import cost
from cachepilot.core.policies import LIVE_POLICIES

F = TypeVar("F", bound=Callable[..., Any])


def policy_option(registry: Mapping[str, object] = LIVE_POLICIES, default: str | None = "priced",
                  help: str | None = None) -> Callable[[F], F]:
    """``--policy`` as a choice of ``registry``'s names: ``--help`` and a typo list them."""
    return click.option("--policy", type=click.Choice(sorted(registry)), default=default,
                        show_default=default is not None, help=help)


def _check(parse: Callable[[str | None], dict[str, float]]
           ) -> Callable[[click.Context, click.Parameter, str | None], str | None]:
    def callback(_ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        try:
            parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param=param) from None
        return value
    return callback


def weights_option(help: str = "e.g. prefill=1,load=1,kv=1") -> Callable[[F], F]:
    """``--weights NAME=NUMBER,…``, checked against the cost model's weight names."""
    return click.option("--weights", default=None, metavar="prefill=1,load=1,kv=1",
                        callback=_check(cost.parse_weights), help=help)


def cost_option(help: str) -> Callable[[F], F]:
    """``--cost NAME=NUMBER,…``, checked against the cost model's parameter names."""
    return click.option("--cost", default=None, metavar="NAME=NUMBER,…",
                        callback=_check(cost.parse_cost), help=help)


def stack_failed(exc: BaseException, log_dir: object) -> click.ClickException:
    """A stack that did not start: the first line of why, and where its logs are."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
    first = lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
    where = f" (logs: {log_dir})" if log_dir and str(log_dir) != "." and Path(
        str(log_dir)).exists() else ""
    return click.ClickException(f"{first}{where}")


def svg_option(f: F) -> F:
    """``--svg FILE``: the command's table also saved as an SVG image (rich's own export;
    the docs' screenshots are made this way)."""
    return click.option("--svg", "svg_path", default=None, metavar="FILE.svg",
                        type=click.Path(dir_okay=False, writable=True),
                        help="Also save the printed table as an SVG image.")(f)


def check_svg(svg_path: str | None, as_json: bool) -> None:
    """``--svg`` saves the table, which ``--json`` does not print."""
    if svg_path and as_json:
        raise click.UsageError("--svg saves the printed table; it cannot go with --json")


def save_svg(console: Any, path: str | None, title: str) -> None:
    """Write what a ``Console(record=True)`` printed to ``path`` (when given)."""
    if path:
        try:
            console.save_svg(path, title=title)
        except OSError as exc:
            raise click.ClickException(f"cannot write {path}: {exc.strerror}") from None
