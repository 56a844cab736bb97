"""docs/reference/cli.md: every ``smetric`` subcommand, from its argparse parser.

Each subcommand's parser is built as ``smetric`` builds it (:data:`stack.cli.SUBCOMMANDS`: the
module's ``add_arguments``), with every module imported. Defaults that are paths inside the
repository are written relative to it, as ``--help`` writes them.
"""

from __future__ import annotations

import argparse
import importlib
import os

from stack.cli import DESCRIPTION, SUBCOMMANDS
from stack.paths import repo_relative
from stack.reference.markdown import HEADER, code, table, value


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """The parser of ``smetric NAME``, as ``smetric NAME --help`` builds it."""
    module, help_ = SUBCOMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"smetric {name}", description=help_)
    importlib.import_module(module).add_arguments(parser)
    return parser


def _flags(a: argparse.Action) -> str:
    if a.option_strings:
        names = ", ".join(a.option_strings)
        if a.nargs == 0:
            return names
        metavar = a.metavar if isinstance(a.metavar, str) else a.dest.upper()
        if isinstance(a.metavar, tuple):
            metavar = " ".join(a.metavar)
        suffix = {"?": f" [{metavar}]", "*": f" [{metavar} ...]", "+": f" {metavar} [...]"}.get(
            str(a.nargs), f" {metavar}"
        )
        return names + suffix
    return a.metavar if isinstance(a.metavar, str) else a.dest


def _default(a: argparse.Action) -> str:
    d = a.default
    if d is None or d is argparse.SUPPRESS or a.nargs == 0 and d is False:
        return ""
    if isinstance(d, str) and os.path.isabs(d):
        d = repo_relative(d)
    return code(value(d) if not isinstance(d, str) else d)


def _help(a: argparse.Action, prog: str) -> str:
    if not a.help or a.help is argparse.SUPPRESS:
        return ""
    params = {k: v for k, v in vars(a).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if isinstance(params.get("default"), str) and os.path.isabs(params["default"]):
        params["default"] = repo_relative(params["default"])
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    text = a.help % params if "%" in a.help else a.help
    if a.choices is not None and not isinstance(a.choices, dict):
        text += " (one of: " + ", ".join(str(c) for c in a.choices) + ")"
    return text


def _sub_parsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The nested subcommands of ``p`` (an action whose choices are parsers)."""
    out = []
    for a in p._actions:  # argparse has no public list of a parser's actions
        if isinstance(a.choices, dict) and all(
            isinstance(v, argparse.ArgumentParser) for v in a.choices.values()
        ):
            out += list(a.choices.items())
    return out


def _section(p: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{p.prog}`\n"]
    if p.description:
        out.append("```text\n" + p.description.strip("\n") + "\n```\n")
    out.append("```text\n" + p.format_usage().strip() + "\n```\n")
    rows = [
        (code(_flags(a)), _default(a), _help(a, p.prog))
        for a in p._actions
        if a.help is not argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
        and not (
            isinstance(a.choices, dict)
            and a.choices
            and all(isinstance(v, argparse.ArgumentParser) for v in a.choices.values())
        )
    ]
    if rows:
        out.append(table(("Argument", "Default", "Help"), rows))
    for _, sub in _sub_parsers(p):
        out += _section(sub, level + 1)
    return out


def render() -> str:
    """The page (usage lines wrapped at 100 columns, whatever the terminal)."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        out = [
            HEADER,
            "# CLI reference\n",
            "```text\n" + DESCRIPTION.strip() + "\n```\n",
            table(
                ("Command", "What it does"),
                ((f"[`smetric {n}`](#smetric-{n})", h) for n, (_, h) in SUBCOMMANDS.items()),
            ),
        ]
        for name in SUBCOMMANDS:
            out += _section(subcommand_parser(name), 2)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)
