"""``ucp convert``: another framework's checkpoint -> UCP (logic in ``ucpformat.importers.cli``)."""

from __future__ import annotations

import argparse
from typing import Any

from ucpformat.importers.cli import add_convert
from ucpformat.importers.cli import run_convert as run


def register(subparsers: Any, parent: argparse.ArgumentParser) -> None:
    add_convert(subparsers, parent)


__all__ = ["register", "run"]
