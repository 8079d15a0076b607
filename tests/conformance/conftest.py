"""Shared helpers of the conformance tests: adapter commands run from this checkout."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucpformat.conformance.adapter import Adapter

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = REPO / "conformance" / "adapters"
BROKEN = Path(__file__).resolve().parent / "broken"
#: Runs a script with every import of ucpformat refused (the independent adapters).
BLOCK_UCPFORMAT = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "ucpformat" or name.startswith("ucpformat."):
            raise ImportError(name + " is blocked: this adapter must not use ucpformat")
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def adapter(*command: str | Path, timeout: float = 300.0) -> Adapter:
    """An adapter command that imports this checkout's ucpformat (not an installed one)."""
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return Adapter([str(c) for c in command], timeout=timeout, env=env, cwd=REPO)


def reference() -> Adapter:
    return adapter(sys.executable, "-m", "ucpformat.conformance.adapters.reference")


def independent(script: str) -> Adapter:
    """An independent adapter, run with ucpformat blocked."""
    return adapter(sys.executable, "-c", BLOCK_UCPFORMAT, ADAPTERS / script)


def broken(script: str) -> Adapter:
    return adapter(sys.executable, BROKEN / script)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(autouse=True, scope="session")
def _scratch_in_memory() -> Iterator[None]:
    """The suites' scratch folders on tmpfs when there is one: adapters write (and fsync)
    hundreds of small files, which costs seconds per scenario on some disks."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield
        return
    before = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="ucp-conformance-", dir=shm) as scratch:
        tempfile.tempdir = scratch
        try:
            yield
        finally:
            tempfile.tempdir = before
