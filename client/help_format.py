"""How every `kvmesh` subcommand shows its help: one formatter and the subparser that uses it."""

from __future__ import annotations

import argparse

# Flags whose default may come from the environment and hold a secret (a token, a Redis URL with
# its password): --help never prints their value.
_SECRET_DESTS = frozenset({"redis_url", "token", "auth_token", "admin_token"})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where X says something: not for None, "", switches, or help
    text that already explains its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        silent = default is None or default is False or default in ("", argparse.SUPPRESS)
        silent = silent or action.dest in _SECRET_DESTS
        if silent or "default" in text:
            return text
        return super()._get_help_string(action)


def subparser(sub: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    return sub.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        formatter_class=HelpFormatter,
    )
