"""What the command lines (recipes, benchmarks, `hf-hybrid-spec-serve`) share: a help formatter that shows every
option's default and keeps the description's layout, `--version`, and a device default resolved after parsing.

Light on purpose (argparse and importlib.metadata only): a script builds its parser with `argument_parser` before it
imports torch or transformers, so `--help`, `--version` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import copy
from importlib import metadata

__all__ = ["HelpFormatter", "argument_parser", "add_version", "version_text", "resolve_device"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every option, those without a help text included (argparse shows them only beside help);
    the description printed as written."""

    def _get_help_string(self, action):
        # A help text that already says its default (or a default of None: "not set") keeps its words as they are.
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action):
        if not action.help and action.option_strings and action.default not in (None, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)


def version_text() -> str:
    """"hf_hybrid_spec X (torch Y, transformers Z)", read from the installed distributions (nothing imported)."""
    parts = []
    for name in ("hf_hybrid_spec", "torch", "transformers"):
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    return f"{parts[0]} ({', '.join(parts[1:])})"


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--version", action="version", version=version_text())
    return parser


def argument_parser(description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An `ArgumentParser` with `HelpFormatter` and `--version`."""
    kwargs.setdefault("formatter_class", HelpFormatter)
    return add_version(argparse.ArgumentParser(description=description, **kwargs))


def resolve_device(name: str) -> str:
    """"auto": "cuda" where torch sees a GPU, else "cpu"; any other name as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
