"""Property tests of the slicing math: random shapes, degrees and part sizes.

Every element is covered exactly once per replica set, local maps are consistent with
their local shapes, and a distributed save followed by a resharding read is exact.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucpformat
from ucpformat.distributed import Fragment, TensorSpec, read_local, save_fragments
from ucpformat.distributed.comm import ThreadGroup, run_threads
from ucpformat.layout.boxes import (
    LocalMap,
    as_slices,
    box_shape,
    box_size,
    flat_range_to_boxes,
)
from ucpformat.layout.dtensor import Replicate, Shard, StridedShard, dtensor_local_map
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords, local_map
from ucpformat.layout.semantics import GROUP_MAJOR, PART_MAJOR, Part, TensorLayout
from ucpformat.layout.zero import flat_partition

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def coverage_count(shape: tuple[int, ...], maps: list[LocalMap]) -> np.ndarray[Any, Any]:
    """How many times each element of the consolidated tensor appears in the maps."""
    count = np.zeros(shape, dtype=np.int64)
    for m in maps:
        covered_local = 0
        for p in m.pieces:
            count[as_slices(p.glob)] += 1
            covered_local += box_size(p.local)
        assert covered_local <= math.prod(m.local_shape)
    return count


def materialize(x: np.ndarray[Any, Any], m: LocalMap) -> np.ndarray[Any, Any]:
    out = np.zeros(m.local_shape, dtype=x.dtype)
    for p in m.pieces:
        if box_shape(p.local) == box_shape(p.glob):
            out[as_slices(p.local)] = x[as_slices(p.glob)]
        else:
            ((a, b),) = p.local
            out.reshape(-1)[a:b] = x[as_slices(p.glob)].reshape(-1)
    return out


@st.composite
def fused_case(draw: Any) -> tuple[tuple[int, ...], TensorLayout, int, str]:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    groups = draw(st.sampled_from([None, tp, 2 * tp]))
    g = groups or tp
    nparts = draw(st.integers(1, 3))
    sizes = [g * draw(st.integers(1, 4)) for _ in range(nparts)]
    other = draw(st.integers(0, 3))
    dim = draw(st.integers(0, 1)) if other else 0
    shape = [other] if other else []
    shape.insert(dim, sum(sizes))
    layout = TensorLayout(
        tp_dim=dim, parts=tuple(Part(f"p{i}", s) for i, s in enumerate(sizes)), groups=groups
    )
    order = draw(st.sampled_from([PART_MAJOR, GROUP_MAJOR]))
    return tuple(shape), layout, tp, order


@SETTINGS
@given(fused_case())
def test_fused_parts_cover_each_element_once(
    case: tuple[tuple[int, ...], TensorLayout, int, str],
) -> None:
    shape, layout, tp, order = case
    cfg = ParallelConfig(tp=tp)
    maps = [
        local_map(shape, layout, Conventions(fused_order=order), cfg, RankCoords(tp=r))
        for r in range(tp)
    ]
    assert all(m is not None for m in maps)
    real = [m for m in maps if m is not None]
    assert (coverage_count(shape, real) == 1).all()
    # each rank holds 1/tp of every part
    dim = layout.tp_dim
    assert dim is not None
    for m in real:
        assert m.local_shape[dim] == shape[dim] // tp
        assert not m.has_padding


@SETTINGS
@given(st.integers(1, 70), st.integers(1, 4), st.sampled_from([None, 1, 8, 64]), st.integers(1, 3))
def test_vocab_padding_covers_real_rows_once(
    vocab: int, tp: int, multiple: int | None, width: int
) -> None:
    layout = TensorLayout(tp_dim=0, vocab_dim=0)
    conv = Conventions(vocab_multiple=multiple)
    maps = [
        local_map((vocab, width), layout, conv, ParallelConfig(tp=tp), RankCoords(tp=r))
        for r in range(tp)
    ]
    real = [m for m in maps if m is not None]
    assert (coverage_count((vocab, width), real) == 1).all()
    rows = {m.local_shape[0] for m in real}
    assert len(rows) == 1  # every rank holds the same padded number of rows
    step = (multiple or 1) * tp
    assert rows.pop() * tp == -(-vocab // step) * step


@SETTINGS
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=3),
    st.integers(1, 5),
    st.sampled_from(["dim0", "flat"]),
)
def test_zero3_partitions_cover_each_element_once(shape: list[int], dp: int, style: str) -> None:
    from ucpformat.layout.rank_slices import zero3_flat_map

    shp = tuple(shape)
    cfg = ParallelConfig(dp=dp, zero=3, zero_style=style)
    maps = []
    for r in range(dp):
        m = local_map(shp, TensorLayout(), Conventions(), cfg, RankCoords(dp=r))
        assert m is not None
        if style == "flat":
            m = zero3_flat_map(
                local_map(shp, TensorLayout(), Conventions(), cfg, RankCoords(dp=r), zero3=False)
                or m,
                dp,
                r,
            )
        maps.append(m)
    assert (coverage_count(shp, maps) == 1).all()
    x = np.arange(math.prod(shp)).reshape(shp)
    if style == "dim0" and shp:
        got = np.concatenate([materialize(x, m) for m in maps], axis=0)
        assert np.array_equal(got, x)
    if style == "flat":
        got = np.concatenate([materialize(x, m) for m in maps])[: x.size]
        assert np.array_equal(got, x.reshape(-1))


@SETTINGS
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=4),
    st.integers(1, 5),
    st.integers(1, 4),
)
def test_flat_partitions_cover_each_parameter_once(
    shapes: list[list[int]], dp: int, align: int
) -> None:
    params = [
        (
            f"t{i}",
            local_map(tuple(s), TensorLayout(), Conventions(), ParallelConfig(), RankCoords()),
        )
        for i, s in enumerate(shapes)
    ]
    real = [(n, m) for n, m in params if m is not None]
    parts = [flat_partition(real, dp, r, align=align) for r in range(dp)]
    assert len({p.size for p in parts}) == 1
    assert parts[0].size * dp >= parts[0].total
    assert (parts[0].size * dp) % (dp * align) == 0
    for (name, _m), shape in zip(real, shapes, strict=True):
        count = np.zeros(tuple(shape), dtype=np.int64)
        for part in parts:
            for piece in part.pieces:
                if piece.tensor == name:
                    count[as_slices(piece.glob)] += 1
        assert (count == 1).all()
    # buffer order: concatenating partitions gives the group's tensors raveled in order
    data = {
        n: np.arange(math.prod(m.local_shape), dtype=np.int64) + 1000 * i
        for i, (n, m) in enumerate(real)
    }
    flat = np.concatenate([data[n] for n, _ in real]) if real else np.zeros(0, np.int64)
    buffers = []
    for part in parts:
        buf = np.full(part.size, -1, dtype=np.int64)
        for piece in part.pieces:
            src = data[piece.tensor].reshape(dict(real)[piece.tensor].local_shape)
            buf[piece.offset : piece.offset + piece.size] = src[as_slices(piece.glob)].reshape(-1)
        buffers.append(buf)
    assert np.array_equal(np.concatenate(buffers)[: flat.size], flat)


@SETTINGS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.integers(0, 1000))
def test_flat_range_to_boxes_is_c_order(shape: list[int], seed: int) -> None:
    total = math.prod(shape)
    rng = np.random.default_rng(seed)
    a, b = sorted(int(v) for v in rng.integers(0, total + 1, size=2))
    x = np.arange(total).reshape(shape)
    boxes = flat_range_to_boxes(shape, a, b)
    assert len(boxes) <= 2 * len(shape) - 1
    got = (
        np.concatenate([x[as_slices(bx)].reshape(-1) for bx in boxes])
        if boxes
        else np.zeros(0, int)
    )
    assert np.array_equal(got, np.arange(a, b))


@st.composite
def mesh_case(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[Any]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    mesh = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
    placements: list[Any] = []
    for i in range(len(mesh)):
        kind = draw(st.sampled_from(["shard", "replicate", "strided"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "shard":
            placements.append(Shard(d))
        elif kind == "strided" and i + 1 < len(mesh):
            placements.append(StridedShard(d, mesh[i + 1]))
        else:
            placements.append(Replicate())
    return shape, mesh, placements


@SETTINGS
@given(mesh_case())
def test_dtensor_placements_cover_each_element_once_per_replica(case: Any) -> None:
    shape, mesh, placements = case
    replicas = math.prod(
        n for n, p in zip(mesh, placements, strict=True) if isinstance(p, Replicate)
    )
    maps = [
        dtensor_local_map(shape, mesh, placements, c)
        for c in itertools.product(*(range(n) for n in mesh))
    ]
    assert (coverage_count(shape, maps) == replicas).all()
    for m in maps:
        assert not m.has_padding


def test_strided_shard_matches_fsdp2_over_tp() -> None:
    """FSDP2 (dp=2) over TP (tp=2) on dim 0 of 8 rows: TP blocks, then FSDP chunks inside."""
    x = np.arange(8)
    mesh, placements = (2, 2), [StridedShard(0, 2), Shard(0)]
    got = {
        c: materialize(x, dtensor_local_map((8,), mesh, placements, c)).tolist()
        for c in itertools.product(range(2), range(2))
    }
    assert got == {(0, 0): [0, 1], (0, 1): [4, 5], (1, 0): [2, 3], (1, 1): [6, 7]}


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(fused_case(), st.integers(1, 3), st.integers(0, 2**31))
def test_distributed_save_and_resharding_load_round_trip(
    tmp_path: Path, case: Any, target_tp: int, seed: int
) -> None:
    shape, layout, tp, order = case
    conv = Conventions(fused_order=order)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "ckpt"
    spec = TensorSpec("model/w", shape, "float32", {"ucp": {"layout": layout.to_json()}})

    def rank_main(comm: ThreadGroup) -> Any:
        m = local_map(shape, layout, conv, ParallelConfig(tp=tp), RankCoords(tp=comm.rank))
        assert m is not None
        local = materialize(x, m)
        frags = [Fragment("model/w", p.glob, local[as_slices(p.local)]) for p in m.pieces]
        return save_fragments(
            path,
            comm,
            specs=[spec],
            fragments=frags,
            chunk_bytes=64,
            min_shard_bytes=32,
            durable=False,
        )

    run_threads(tp, rank_main)
    ckpt = ucpformat.open(path)
    assert np.array_equal(ckpt["model/w"].read(), x)
    g = layout.groups or tp
    if g % target_tp == 0 and all(p.size % g == 0 for p in layout.parts):
        for r in range(target_tp):
            m = local_map(shape, layout, conv, ParallelConfig(tp=target_tp), RankCoords(tp=r))
            assert m is not None
            assert np.array_equal(read_local(ckpt, "model/w", m), materialize(x, m))
