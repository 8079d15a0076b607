"""``ucp export``: UCP -> another framework's format (logic in ``ucpformat.importers.cli``)."""

from __future__ import annotations

import argparse
from typing import Any

from ucpformat.importers.cli import add_export
from ucpformat.importers.cli import run_export as run


def register(subparsers: Any, parent: argparse.ArgumentParser) -> None:
    add_export(subparsers, parent)


__all__ = ["register", "run"]
