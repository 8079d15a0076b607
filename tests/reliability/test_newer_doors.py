"""Issue 31 on the core and flat-API doors: an alias that shadows a stored tensor (item 5),
a huge declared shape over tiny chunks (item 8)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucpformat
from ucpformat.errors import FormatError, ResourceLimitError
from ucpformat.layout.boxes import box_shape
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


def _huge(node: dict[str, Any]) -> None:
    node["shape"] = [2**40, node["shape"][1]]


def test_a_huge_declared_shape_is_refused_before_allocating(tmp_path: Path) -> None:
    """Before: load_file allocated 32 TiB for the declared shape before reading a chunk
    (numpy's MemoryError), on every load path."""
    root = _edited(tmp_path, "model/fc.weight", _huge)
    with ucpformat.open(root) as ckpt:
        assert ckpt["model/fc.weight"].shape[0] == 2**40  # opening allocates nothing
        with pytest.raises(ResourceLimitError, match=r"fc\.weight"):
            ckpt["model/fc.weight"].read()
        from ucpformat.distributed import read_locals
        from ucpformat.layout.boxes import LocalMap, Piece, full_box

        box = full_box(ckpt["model/fc.weight"].shape)
        with pytest.raises(ResourceLimitError, match=r"R090.*fc\.weight"):
            read_locals(ckpt, [("model/fc.weight", LocalMap(box_shape(box), (Piece(box, box),)),
                                None)])
    torch_flat = pytest.importorskip("ucpformat.torch.flat")
    with pytest.raises(ResourceLimitError, match=r"fc\.weight"):
        torch_flat.load_file(root)
    with torch_flat.safe_open(root) as f, pytest.raises(ResourceLimitError, match=r"fc\.weight"):
        f.get_tensor("fc.weight")
    import ucpformat.torch as ucpt

    with pytest.raises(ResourceLimitError, match=r"fc\.weight"):
        ucpt.load_state_dict(root)
    # a bound the caller states: a small tensor over it is refused too
    with ucpformat.open(root, max_read_bytes=64) as ckpt, pytest.raises(ResourceLimitError):
        torch_flat.load_file(ckpt)
