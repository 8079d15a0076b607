"""Issue 31 on the core and flat-API doors: an alias that shadows a stored tensor (item 5),
a huge declared shape over tiny chunks (item 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucpformat
from ucpformat.errors import FormatError
from ucpformat.testing import hostile


def _edited(tmp_path: Path, path: str, edit: Any) -> Path:
    """The hostile harness's fixture with the node ``path`` edited (root sealed again)."""
    fx = hostile.make_fixture(tmp_path, compression=None)
    node = fx.doc(f"{path}/zarr.json")
    edit(node)
    for key, data in hostile._with_node(fx, path, node).items():
        assert data is not None
        (fx.root / key).write_bytes(data)
    return fx.root


def _alias(target: str) -> Any:
    def edit(node: dict[str, Any]) -> None:
        node.setdefault("attributes", {}).setdefault("ucp", {})["aliases"] = {
            "fc.weight": target}
    return edit


@pytest.mark.parametrize("target", ["emb.weight", "missing.weight"])
def test_an_alias_that_shadows_a_stored_tensor_is_refused_on_open(
    tmp_path: Path, target: str
) -> None:
    """Before: load_file and safe_open returned emb.weight's values as fc.weight, silently,
    and ucpformat.open accepted the checkpoint; only validate reported R108."""
    root = _edited(tmp_path, "model", _alias(target))
    with pytest.raises(FormatError, match=r"R108.*fc\.weight"):
        ucpformat.open(root)
    assert "UCP-1.0-R108" in {i.rule for i in ucpformat.validate(root).errors}
    torch_flat = pytest.importorskip("ucpformat.torch.flat")
    with pytest.raises(FormatError, match="R108"):
        torch_flat.load_file(root)
    with pytest.raises(FormatError, match="R108"):
        torch_flat.safe_open(root)
