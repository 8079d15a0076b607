"""The scale benchmark measures the real thing: its simulated plans are those of a real save.

``benchmarks/bench_scale.py`` simulates thousands of ranks in one process (descriptions
from :mod:`benchmarks.scale_layouts`, the coordinator's
:func:`ucpformat.distributed.pipeline.plan_shares`, each rank's
:func:`ucpformat.distributed.pipeline.take_share`). Here 4 gloo processes save the same layouts
with real values, recording the share each rank received; the simulation must hand every rank
exactly that share, and the checkpoint must hold the values. The layouts: a small Llama-shaped
model under TP 2 x DP 2 with flat ZeRO-1 partitions of the fp32 states, and under FSDP2 x TP on a
(2, 2) mesh described by mesh and placements; fine shards, so that cells move.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import scale_layouts as L
from ucpformat.distributed.rank_description import describe, encode_description
from ucpformat.distributed.save_plan import PlanOptions
from ucpformat.format import dtypes
from ucpformat.layout.boxes import Box, box_shape


def _gloo_available() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


GLOO = _gloo_available()
TINY = L.Transformer("tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48,
                     vocab=40)
OPTIONS = PlanOptions(None, chunk_bytes=256, shard_bytes=2048, min_shard_bytes=1024)


SCENARIOS = {"zero1": lambda: L.megatron(TINY, 2, 1, 2), "fsdp2": lambda: L.fsdp2(TINY, 2, 2)}


def values(shape: tuple[int, ...], box: Box, dtype: str) -> np.ndarray[Any, Any]:
    """The values of ``box``: each element's flat index in the full tensor, mod 251."""
    idx = np.indices(box_shape(box)) + np.array([a for a, _ in box]).reshape(
        (-1,) + (1,) * len(box))
    flat = np.ravel_multi_index(tuple(idx), shape) % 251 if box else np.zeros(())
    return np.asarray(flat, dtype=np.float32).astype(dtypes.by_name(dtype).numpy)


def save_rank(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    """Worker: save this rank's part of the layout over gloo; the share it received."""
    import ucpformat.distributed.pipeline as pipeline
    from ucpformat.distributed import Fragment, save_fragments
    from ucpformat.torch.comm import TorchCommunicator

    sim = next(r for r in SCENARIOS[kind]().ranks() if r.rank == rank)
    spec_of = {s.path: s for s in sim.specs}
    frags = [Fragment(p, box, values(spec_of[p].shape, box, spec_of[p].dtype).reshape(-1))
             for p, box in sim.all_boxes()]
    seen: dict[str, Any] = {}
    real = pipeline.take_share

    def recording(*args: Any, **kwargs: Any) -> pipeline.Share:
        share = real(*args, **kwargs)
        assert share.tasks is not None
        seen["tasks"] = share.tasks.to_json()
        return share

    pipeline.take_share = recording  # type: ignore[assignment]
    save_fragments(root, TorchCommunicator(), specs=sim.specs, fragments=frags,
                     meshes=sim.meshes, on_mesh=sim.on_mesh, chunk_bytes=OPTIONS.chunk_bytes,
                     shard_bytes=OPTIONS.shard_bytes,
                     min_shard_bytes=OPTIONS.min_shard_bytes, durable=False)
    return seen


def simulated_shares(kind: str) -> list[dict[str, Any]]:
    """Each rank's share as the benchmark computes it, in one process."""
    from ucpformat.distributed.pipeline import plan_shares, take_share
    from ucpformat.store import LocalStore

    sc = SCENARIOS[kind]()
    docs = [{**describe(r.specs, r.boxes, meshes=r.meshes, on_mesh=r.on_mesh), "error": ""}
            for r in sc.ranks()]
    blobs = [encode_description(d) for d in docs]

    class NoStore(LocalStore):  # the plan's destination is never written here
        def put(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
            return 0

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plan, shares, _, error = plan_shares(blobs, OPTIONS, NoStore(tmp), overwrite=True)
    assert error is None and plan is not None
    out = []
    for rank in range(sc.world):
        share = take_share(shares[rank], plan if rank == 0 else None, rank, None, docs[rank])
        assert share.tasks is not None
        out.append(share.tasks.to_json())
    return out


@pytest.mark.parametrize("kind", sorted(SCENARIOS))
def test_the_simulated_plan_moves_boundary_cells(kind: str) -> None:
    """The layout is one that exercises the exchange (else the comparison proves less)."""
    shares = simulated_shares(kind)
    assert any(s["sends"] for s in shares) and all(s["objects"] for s in shares)


@pytest.mark.torch
@pytest.mark.distributed
@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("kind", sorted(SCENARIOS))
def test_simulated_plans_equal_a_real_gloo_save(tmp_path: Path, kind: str) -> None:
    import ucpformat
    from ucpformat.torch.launch import spawn

    real = spawn(save_rank, 4, str(tmp_path / "ckpt"), kind, timeout=240)
    simulated = simulated_shares(kind)
    for rank in range(4):
        assert json.dumps(real[rank]["tasks"], sort_keys=True) == json.dumps(
            simulated[rank], sort_keys=True), f"rank {rank}"
    ckpt = ucpformat.open(tmp_path / "ckpt")
    specs = {s.path: s for r in SCENARIOS[kind]().ranks() for s in r.specs}
    assert set(ckpt) == set(specs)
    for path, spec in specs.items():
        full = tuple((0, n) for n in spec.shape)
        assert np.array_equal(ckpt[path].read(), values(spec.shape, full, spec.dtype)), path
