"""MkDocs hook: the CLI reference page (docs/reference/cli.md) written from specdec's own argparse
parser (build_parser in specdec/cli/) at build time, so the page cannot drift from the command.

The page holds the marker line `<!-- cli-reference -->`; it is replaced by one section per
subcommand: its usage line, description, and a table of its arguments with their help and
default, as `specdec COMMAND --help` formats them. The repository root (the folder of
mkdocs.yml) is put first on sys.path, so the specdec being documented is the one beside the docs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
WIDTH = 100


def on_config(config):
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker line {MARKER!r}: put it back where the reference goes")
    return markdown.replace(MARKER, cli_reference())


def cli_reference() -> str:
    from specdec.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help for choice in action._choices_actions}  # each command's one-line help
    lines = ["| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#{name}) | {cell(summaries.get(name) or '')} |" for name in action.choices] + [""]
    for name, sub in action.choices.items():
        lines += command_section(name, sub)
    return "\n".join(lines)


def command_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser.formatter_class(prog=parser.prog, width=WIDTH)  # not the terminal's width: the same page anywhere
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    usage = formatter.format_help().strip("\n")
    lines = [f"## {name}", "", "```text", usage, "```", ""]
    if parser.description:
        lines += [parser.description, ""]
    lines += ["| argument | what it does |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        if action.choices:
            flags += "<br>one of " + ", ".join(f"`{c}`" for c in action.choices)
        elif action.metavar or action.option_strings and action.nargs != 0:
            flags += f" {metavar(formatter, action)}"
        text = formatter._expand_help(action) if action.help else ""  # with its default, as --help shows it
        lines.append(f"| {cell(flags)} | {cell(text)} |")
    return lines + [""]


def metavar(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    default = action.dest.upper() if action.option_strings else action.dest
    return f"`{formatter._format_args(action, default)}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
