"""``--json``: one meaning in every command of ``gradsync`` that prints rows.

``gradsync bench``, ``plan`` and ``simulate`` all take it: ``--json FILE`` writes the rows to
FILE as JSON; ``--json`` alone (or ``--json -``) prints them to stdout (``plan`` and
``simulate``: instead of their table). It lives here, below the tools, so that ``simulate``
and ``bench`` share it without importing each other.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["JSON_HELP", "add_json_option", "write_json"]

JSON_HELP = "the rows as JSON: written to FILE, or to stdout (instead of the table) without FILE"


def add_json_option(parser) -> None:
    """Adds ``--json [FILE]`` (this package's one meaning of ``--json``) to a parser or group;
    the parsed value is None (no JSON), ``"-"`` (stdout) or the file's path."""
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE", help=JSON_HELP)


def write_json(data: Any, target: str) -> None:
    """Writes ``data`` as JSON to ``target``: a path, or ``"-"`` for stdout."""
    if target == "-":
        json.dump(data, sys.stdout, indent=1)
        print()
        return
    with open(target, "w") as out:
        json.dump(data, out, indent=1)
        out.write("\n")
