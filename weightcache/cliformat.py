"""One help style for every subcommand: each flag says what it does and its default."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where the help text already states the default
    in words (e.g. "default: a private per-user directory"), which says more than "None"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)
