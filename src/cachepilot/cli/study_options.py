"""What ``cachepilot experiment``'s commands share: defaults read from the study that owns
them without importing it up front, comma-separated name lists, the command line that
reproduces a run (written into the study's output folder), and the one-line refusal when an
optional extra is missing.

The studies (:mod:`cachepilot.lab`) load only when their command runs, so listing them or a
base install (``pip install .``, no extras) never fails on a study's dependencies; yet each
default stays where the study defines it and ``--help`` still shows its value.
"""

from __future__ import annotations

import importlib
import importlib.util
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from cachepilot.lab.output import StudyOutput


def resolve(ref: str) -> Any:
    """``"package.module:Name.attr"`` → that object (the module is imported now)."""
    module, _, path = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class StudyOption(click.Option):
    """An option whose default (``study_default="module:attr"``) and the values its help
    names (``help_refs``: placeholder → ``"module:attr"``, filled into ``help``) are a
    study's own, read when the command runs or shows its help, not when the CLI is imported.
    ``convert`` turns the study's default into the option's (a tuple of names into a
    comma-separated string)."""

    def __init__(self, *args: Any, study_default: str | None = None,
                 convert: Callable[[Any], Any] | None = None,
                 help_refs: dict[str, str] | None = None, **kwargs: Any) -> None:
        if study_default is not None:
            kwargs.setdefault("show_default", True)
        super().__init__(*args, **kwargs)
        self.study_default = study_default
        self.convert = convert
        self.help_refs = help_refs or {}

    def get_default(self, ctx: click.Context, call: bool = True) -> Any:
        if self.study_default is None:
            return super().get_default(ctx, call)
        value = resolve(self.study_default)
        return self.convert(value) if self.convert else value

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        template = self.help
        if template and self.help_refs:
            self.help = template.format(**{k: _text(resolve(ref))
                                           for k, ref in self.help_refs.items()})
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = template


def _text(value: Any) -> str:
    """A value as help text: names comma-separated, anything else as it prints."""
    if isinstance(value, dict | list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def names(choices_ref: str) -> Callable[[click.Context, click.Parameter, str], list[str]]:
    """A callback parsing a comma-separated list of names, each a key of the mapping at
    ``choices_ref`` (read when the option is parsed)."""

    def parse(_ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
        choices = list(resolve(choices_ref))
        picked = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in picked if n not in choices]
        if bad or not picked:
            raise click.BadParameter(f"{', '.join(bad) or 'none given'}: choose from "
                                     f"{', '.join(choices)}", param=param)
        return picked

    return parse


def command_line(ctx: click.Context, **resolved: Any) -> str:
    """The command that reproduces this run: every option with the value it ran with
    (defaults spelled out, so a later change of default does not change what it means);
    ``resolved`` overrides values the command worked out itself (a trace found by default)."""
    names: list[str] = []
    c: click.Context | None = ctx
    while c is not None and c.parent is not None:  # not the root's name: `python -m …`
        names.insert(0, c.info_name or "")
        c = c.parent
    argv = ["cachepilot", *names]
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name is None:
            continue
        value = resolved.get(p.name, ctx.params.get(p.name))
        if value is None or value is False or (p.multiple and not value):
            continue
        if p.is_flag:
            argv.append(p.opts[0])
        elif p.multiple:  # given once per value
            for v in value:
                argv += [p.opts[0], str(v)]
        elif isinstance(value, list | tuple):
            argv += [p.opts[0], ",".join(str(v) for v in value)]
        else:
            argv += [p.opts[0], f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(argv)


def study_output(ctx: click.Context, folder: str, /, **resolved: Any) -> StudyOutput:
    """The study's output folder, with the command line that reproduces this run
    (``resolved`` may name ``out_dir`` too: a default the command worked out)."""
    from cachepilot.lab.output import StudyOutput

    return StudyOutput(Path(folder), command_line(ctx, **resolved))


def require_extra(extra: str, *modules: str) -> None:
    """One line naming the extra to install when a module the study needs is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(f"this study needs {', '.join(missing)}: pip install "
                                   f"'cachepilot[{extra}]'")


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"100-109"`` (a range, both ends included), ``"1,2,5"`` or ``"10"`` (a count: seeds
    0 to 9, as the option always took) → the seeds; ValueError otherwise."""
    text = text.strip()
    try:
        if "-" in text:
            lo, _, hi = text.partition("-")
            first, last = int(lo), int(hi)
            if first < 0 or last < first:
                raise ValueError
            return tuple(range(first, last + 1))
        if "," in text:
            seeds = tuple(int(s) for s in text.split(",") if s.strip())
            if len(set(seeds)) != len(seeds) or min(seeds) < 0:
                raise ValueError
            return seeds
        n = int(text)
        if n < 1:
            raise ValueError
        return tuple(range(n))
    except ValueError:
        raise ValueError(f"{text!r}: a range A-B, a list A,B,C or a count N") from None


def seeds_text(seeds: tuple[int, ...]) -> str:
    """The seeds as the option spells them: ``A-B`` when consecutive, else ``A,B,C``."""
    if len(seeds) > 1 and seeds == tuple(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def seeds_callback(at_least: int = 2) -> Callable[[click.Context, click.Parameter, str], str]:
    """A ``--seeds`` callback: the value checked and spelled canonically (so the command
    written into a study's folder names the seeds, not a count)."""

    def check(_ctx: click.Context, param: click.Parameter, value: str) -> str:
        try:
            seeds = parse_seeds(str(value))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param=param) from None
        if len(seeds) < at_least:
            raise click.BadParameter(f"{value!r}: at least {at_least} seeds", param=param)
        return seeds_text(seeds)

    return check
