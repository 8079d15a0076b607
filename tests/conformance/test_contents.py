"""The language-neutral definitions: splitmix64 contents and digests of selections."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ucpformat.conformance import contents
from ucpformat.format import dtypes


def test_splitmix64_test_vector() -> None:
    for x, expected in contents.TEST_VECTOR:
        assert contents.splitmix64(x) == expected
    words = contents.words(2**64 - 2, 3)
    assert [int(w) for w in words] == [contents.splitmix64(2**64 - 2),
                                        contents.splitmix64(2**64 - 1), contents.splitmix64(0)]


def test_stream_is_little_endian_words() -> None:
    raw = contents.stream(5, 20)
    assert raw[:8] == contents.splitmix64(5).to_bytes(8, "little")
    assert raw[8:16] == contents.splitmix64(6).to_bytes(8, "little")
    assert raw[16:] == contents.splitmix64(7).to_bytes(8, "little")[:4]


@pytest.mark.parametrize("name", dtypes.NAMES)
def test_generate_uses_the_stream_bits(name: str) -> None:
    dt = dtypes.by_name(name)
    arr = contents.generate(name, (3, 5), 1234)
    assert arr.dtype == dt.numpy and arr.shape == (3, 5)
    if name == "bool":
        assert arr.tobytes() == bytes(b & 1 for b in contents.stream(1234, 15))
    else:
        assert arr.tobytes() == contents.stream(1234, 15 * dt.itemsize)
    assert contents.sha256(arr) == hashlib.sha256(contents.le_bytes(arr)).hexdigest()


def test_digest_is_c_order_little_endian() -> None:
    arr = np.arange(6, dtype=">i4").reshape(2, 3)
    assert contents.sha256(arr) == hashlib.sha256(
        np.arange(6, dtype="<i4").tobytes()).hexdigest()
    assert contents.sha256(arr.T) == hashlib.sha256(
        np.ascontiguousarray(np.arange(6, dtype="<i4").reshape(2, 3).T).tobytes()).hexdigest()


def test_selections() -> None:
    arr = np.arange(60).reshape(6, 10)
    sel = [[1, 6, 2], [0, 10, 3]]
    assert np.array_equal(contents.select(arr, sel), arr[1:6:2, 0:10:3])
    assert contents.selection_shape(sel) == (3, 4)
    assert contents.box_of(sel) == ([1, 0], [6, 10])
    assert contents.box_of([[2, 2, 1]]) == ([2], [2])
    for bad in ([[0, 7, 1], [0, 1, 1]], [[2, 1, 1], [0, 1, 1]], [[0, 1, 0], [0, 1, 1]],
                [[0, 1, 1]]):
        with pytest.raises(ValueError):
            contents.as_index(bad, arr.shape)
