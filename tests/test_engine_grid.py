"""The grid of stored objects: one rule for what a storage key names (UCP-1.0-R021)."""

from __future__ import annotations

import pytest

from ucpformat.checkpoint.metadata import ArrayMeta
from ucpformat.engine.grid import coords_of_key, object_key, stored_object_coords
from ucpformat.format.dtypes import BY_NAME


def _meta(shape: tuple[int, ...], chunk: tuple[int, ...]) -> ArrayMeta:
    return ArrayMeta(path="model/w", shape=shape, dtype=BY_NAME["float32"], chunk_shape=chunk,
                     shard_shape=None, compression=None, fill_value=0.0)


def test_every_key_the_writer_writes_names_its_coordinates() -> None:
    meta = _meta((25, 7), (2, 3))  # a 13 x 3 grid
    for coords in [(0, 0), (12, 2), (10, 1)]:
        assert coords_of_key(meta, object_key(meta.path, coords)) == coords
    scalar = _meta((), ())
    assert object_key("model/w", ()) == "model/w/c"
    assert coords_of_key(scalar, "model/w/c") == ()


@pytest.mark.parametrize("first", ["00", "01", "+1", "-0", " 1", "1 ", "١", "²", "1_0", "0x1"])
def test_a_coordinate_is_canonical_ascii_decimal(first: str) -> None:
    """Only the key the writer writes names an object: no leading zeros, signs, spaces
    or non-ASCII digits (``"١".isdigit()`` is true, ``int("١")`` is 1)."""
    meta = _meta((25, 7), (2, 3))
    assert coords_of_key(meta, "model/w/c/1/0") == (1, 0)
    assert coords_of_key(meta, f"model/w/c/{first}/0") is None


@pytest.mark.parametrize("suffix", ["13/0", "0/3", "0", "0/0/0", "", "0/", "/0/0"])
def test_keys_outside_the_grid_or_of_another_rank_name_no_object(suffix: str) -> None:
    meta = _meta((25, 7), (2, 3))  # a 13 x 3 grid
    assert coords_of_key(meta, f"model/w/c/{suffix}") is None
    assert coords_of_key(meta, "model/w/c") is None  # only a 0-d array's object is P/c
    assert coords_of_key(meta, "model/wx/c/0/0") is None


def test_stored_object_coords_are_the_canonical_keys_sorted() -> None:
    meta = _meta((25, 7), (2, 3))
    keys = ["model/w/c/10/0", "model/w/c/2/1", "model/w/c/02/1", "model/w/zarr.json",
            "model/w/c/١/0", "model/b/c/0"]
    assert stored_object_coords(meta, keys) == [(2, 1), (10, 0)]
