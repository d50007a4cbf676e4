"""The CLI reference: every command and option, walked from click (through the lazy group,
so each subcommand's module is imported here) and rendered with click's own help records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click

from cachepilot.docgen.markdown import code, generated_note, prose, table

PATH = "reference/cli.md"


def walk(cmd: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command, click.Context]]:
    """Every command under ``cmd`` (itself first), depth first, in ``--help`` order."""
    yield cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            yield from walk(sub, click.Context(sub, info_name=name, parent=ctx))


def root() -> tuple[click.Command, click.Context]:
    from cachepilot.cli import main

    return main, click.Context(main, info_name="cachepilot")


def commands() -> list[str]:
    """Every command's full name (``cachepilot decisions stats``)."""
    cmd, ctx = root()
    return [c.command_path for _, c in walk(cmd, ctx)]


def anchor(command_path: str) -> str:
    return command_path.replace(" ", "-")


def _section(cmd: click.Command, ctx: click.Context) -> str:
    path = ctx.command_path
    depth = min(2 + path.count(" ") - 1, 4) if " " in path else 2
    out = [f"{'#' * depth} `{path}` {{#{anchor(path)}}}\n"]
    doc = (cmd.help or "").strip()
    if doc:
        out.append(click.unstyle(doc).split("\f")[0].strip() + "\n")
    pieces = cmd.collect_usage_pieces(ctx)
    out.append(f"```\n{path} {' '.join(pieces)}\n```\n")
    args = [p for p in cmd.get_params(ctx) if isinstance(p, click.Argument)]
    if args:
        out.append("Arguments: " + ", ".join(
            code(p.make_metavar(ctx)) + ("" if p.required else " (optional)")
            for p in args) + ".\n")
    rows = []
    for p in cmd.get_params(ctx):
        if isinstance(p, click.Argument) or getattr(p, "hidden", False):
            continue
        record = p.get_help_record(ctx)
        if record is None:
            continue
        opts, help_text = record
        # click's "[default: …]" and "[x>=1]" are text, not Markdown links.
        rows.append([code(opts), prose(click.unstyle(help_text)).replace("[", "\\[")])
    if rows:
        out.append(table(["option", "meaning [default]"], rows))
    if isinstance(cmd, click.Group):
        subs = [(n, cmd.get_command(ctx, n)) for n in cmd.list_commands(ctx)]
        out.append("Subcommands: " + ", ".join(
            f"[`{n}`](#{anchor(f'{path} {n}')})" for n, s in subs if s and not s.hidden)
            + ".\n")
    return "\n".join(out)


def page(_root: Path) -> str:
    cmd, ctx = root()
    out = ["# Command line\n", generated_note("src/cachepilot/cli/"),
           "Every `cachepilot` command with its options, as `--help` shows them. "
           "`cachepilot COMMAND --help` prints the same.\n"]
    for c, cctx in walk(cmd, ctx):
        out.append(_section(c, cctx))
    return "\n".join(out)
