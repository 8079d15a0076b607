"""The layout geometry is pure: no module of ``ucpformat.layout`` reaches the checkpoint API.

Boxes, sharding, ZeRO partitions, semantics, rule files and DTensor placements are
arithmetic over shapes and JSON; a loader in another process (or language) computes them
without opening a checkpoint. The framework adapter that reads and writes checkpoints
through them sits in the distributed layer (``distributed/framework.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ucpformat.distributed.framework
import ucpformat.layout

LAYOUT = Path(ucpformat.layout.__file__).resolve().parent
PACKAGE = LAYOUT.parent
ADAPTER = Path(ucpformat.distributed.framework.__file__).resolve()
#: What the pure modules may import from ucpformat besides each other.
ALLOWED = {"ucpformat.errors", "ucpformat.format.schemas", "ucpformat.format.jsonvalues"}


def _ucpformat_imports(path: Path) -> set[str]:
    """Every ucpformat module that ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ucpformat"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            package = PACKAGE.parent.joinpath(*node.module.split("."))
            if (package / "__init__.py").is_file():  # from a package import its modules
                found.update(f"{node.module}.{a.name}" if (package / f"{a.name}.py").is_file()
                             else node.module for a in node.names)
            elif node.module.startswith("ucpformat."):
                found.add(node.module)
    return found


def test_pure_layout_modules_import_no_checkpoint_code() -> None:
    pure = sorted(p for p in LAYOUT.glob("*.py") if p.name != "__init__.py")
    assert {p.name for p in pure} >= {"boxes.py", "rank_slices.py", "zero.py", "semantics.py",
                                      "rules.py", "dtensor.py"}
    own = {f"ucpformat.layout.{p.stem}" for p in pure}
    offenders = {p.name: sorted(_ucpformat_imports(p) - ALLOWED - own) for p in pure}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_adapter_is_the_one_that_reads_checkpoints() -> None:
    # the check above would pass vacuously if the adapter's imports were not seen
    imports = _ucpformat_imports(ADAPTER)
    assert {"ucpformat.checkpoint.reader", "ucpformat.distributed"} <= imports
