"""The layering of the package (docs/architecture.md), checked on every module's imports.

A module may import its own layer and the layers below it, never a layer above; the
core (every layer below ``torch``) never imports torch, not even inside a function.
Imports under ``if TYPE_CHECKING:`` are not imports at run time and are not counted.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ucpformat"

#: Layers from the bottom up: (name, module patterns). A pattern names a module or, ending
#: in ``.*``, a package and everything in it. docs/architecture.md explains each layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "_version", "compat", "optional", "progress", "format.*")),
    ("storage and geometry", ("store.*", "layout.*")),
    ("engine", ("engine.*",)),
    ("checkpoint API", ("", "checkpoint.*")),
    ("distributed pipeline", ("distributed.*",)),
    ("torch", ("torch.*",)),
    ("frameworks", ("interchange", "importers.*", "exporters.*", "deepspeed.*",
                    "megatron.*", "jax.*", "trainers.*")),
    ("tools", ("cli.*", "conformance.*", "testing.*")),
]
#: The modules that sit at the package's root (the foundation every layer shares); every
#: other module is in the package of its layer.
ROOT_MODULES = {"", "errors", "_version", "compat", "optional", "progress", "interchange"}
#: The first layer that may import torch (and the frameworks built on it).
TORCH_LAYER = "torch"
FRAMEWORKS = ("torch", "deepspeed", "megatron", "transformers", "lightning", "accelerate",
              "torchtitan")
#: Framework-layer packages that never import torch (nor ucpformat.torch), not even lazily.
TORCH_FREE = ("jax",)


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module`` (a name relative to ucpformat, '' for itself)."""
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if pattern.endswith(".*"):
                base = pattern[:-2]
                if module == base or module.startswith(base + "."):
                    return index
            elif module == pattern:
                return index
    raise LookupError(f"ucpformat.{module} is in no layer: add it to LAYERS and to "
                      "docs/architecture.md")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_imports(tree: ast.AST, *, package: str) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import executed at run time, wherever it is
    (functions included); ``from a import b`` yields ``a.b`` (b may be a submodule)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        stack.extend(ast.iter_child_nodes(node))


def target_module(name: str) -> str | None:
    """The ucpformat module that importing ``name`` reaches, relative ('' = the package);
    None outside ucpformat. ``ucpformat.format.dtypes.DataType`` reaches ``dtypes``."""
    if name != "ucpformat" and not name.startswith("ucpformat."):
        return None
    parts = name.split(".")[1:]
    while parts:
        candidate = PACKAGE.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return ""


def violations(source: str, module: str) -> list[str]:
    """What ``source``, as ucpformat module ``module``, imports against the layering."""
    mine = layer_of(module)
    package = "ucpformat." + module if module else "ucpformat"
    if not (PACKAGE / module.replace(".", "/") / "__init__.py").is_file():
        package = package.rpartition(".")[0]
    found = []
    for line, name in runtime_imports(ast.parse(source), package=package):
        if module.split(".")[0] in TORCH_FREE and (
                name.split(".")[0] == "torch" or name.startswith("ucpformat.torch")):
            found.append(f"ucpformat.{module}:{line} imports {name} (ucpformat."
                         f"{module.split('.')[0]} never imports torch)")
            continue
        if name.split(".")[0] in FRAMEWORKS and mine < layer_of_name(TORCH_LAYER):
            found.append(f"ucpformat.{module}:{line} imports {name} (the core never "
                         f"imports {name.split('.')[0]})")
            continue
        target = target_module(name)
        if target is None:
            continue
        theirs = layer_of(target)
        if theirs > mine:
            found.append(f"ucpformat.{module}:{line} ({LAYERS[mine][0]}) imports "
                         f"ucpformat.{target} ({LAYERS[theirs][0]}), a higher layer")
    return found


def layer_of_name(name: str) -> int:
    return [n for n, _ in LAYERS].index(name)


def package_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_a_layer() -> None:
    for path in package_modules():
        layer_of(module_name(path))


def test_no_module_imports_a_higher_layer_and_the_core_never_imports_torch() -> None:
    found = [v for path in package_modules()
             for v in violations(path.read_text(encoding="utf-8"), module_name(path))]
    assert not found, "layering violations (docs/architecture.md):\n" + "\n".join(found)


@pytest.mark.parametrize(("module", "source"), [
    ("engine.read", "def f():\n    import torch\n"),
    ("format.dtypes", "from ucpformat.checkpoint.reader import Checkpoint\n"),
    ("engine.codecs", "from ucpformat.checkpoint import writer\n"),
    ("layout.rank_slices", "from ucpformat.distributed import Fragment\n"),
    ("store.local", "from ucpformat.engine.shard_index import decode_index\n"),
    ("checkpoint.reader", "from ucpformat.torch.load_plan import check_device\n"),
    ("torch.state", "from ucpformat.importers import convert\n"),
    ("engine.grid", "from ..metadata import ArrayMeta\n"),
    ("jax.save", "def f():\n    import torch\n"),
    ("jax.load", "from ucpformat.torch.convert import to_numpy\n"),
])
def test_the_checker_finds_what_it_forbids(module: str, source: str) -> None:
    assert violations(source, module), source


@pytest.mark.parametrize(("module", "source"), [
    ("engine.grid", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from ucpformat.checkpoint.metadata import ArrayMeta\n"),
    ("torch.state", "import torch\nfrom ucpformat.distributed.pipeline import save\n"),
    ("checkpoint.writer", "from ucpformat.engine.write import write_object\n"),
    ("cli.inspect", "from ucpformat.torch import load\n"),
])
def test_the_checker_allows_what_the_layers_allow(module: str, source: str) -> None:
    assert not violations(source, module), source


def test_the_architecture_page_names_every_layer() -> None:
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, patterns in LAYERS:
        assert re.search(rf"\b{re.escape(name)}\b", page, re.I), name
        for pattern in patterns:
            if pattern:
                assert f"`{pattern.removesuffix('.*')}" in page, pattern


def test_each_layer_is_a_package() -> None:
    """Apart from the foundation's few root modules, a module's package names its layer:
    every module of a package is in one layer (the tree shows the layers)."""
    layers_of: dict[str, set[int]] = {}
    for path in package_modules():
        module = module_name(path)
        if module in ROOT_MODULES:
            continue
        top = module.split(".")[0]
        assert (PACKAGE / top / "__init__.py").is_file(), (
            f"ucpformat.{module} sits at the package root: put it in its layer's package")
        layers_of.setdefault(top, set()).add(layer_of(module))
    split = {top: sorted(LAYERS[i][0] for i in found)
             for top, found in layers_of.items() if len(found) > 1}
    assert not split, f"packages spread over several layers: {split}"


def test_old_import_paths_still_work_with_a_deprecation_warning() -> None:
    import importlib
    import sys

    from ucpformat.compat import MOVED

    for old, new in MOVED.items():
        if old.split(".")[1] in ("torch", "deepspeed", "megatron"):
            pytest.importorskip("torch")
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=re.escape(new)):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert not (PACKAGE / (old.removeprefix("ucpformat.").replace(".", "/") + ".py")
                    ).is_file(), f"{old} is both moved and still there"
