"""Planning, coordination and metadata at 1,024 to 16,384 simulated ranks, against DCP's planners.

No processes and no data: :mod:`benchmarks.scale_layouts` builds what every rank of a
large run would describe (specs and fragment boxes, from the project's layout geometry),
and this module runs the code a distributed save and a resharded load run on it:

* **save, one rank**: :func:`ucpformat.distributed.rank_description.describe` and
  :func:`~ucpformat.distributed.rank_description.encode_description` (what it sends the
  coordinator), then :func:`ucpformat.distributed.pipeline.take_share` of what the coordinator
  sends back;
* **save, the coordinator**: :func:`ucpformat.distributed.pipeline.plan_shares` (decode every
  description, coverage check, shard grids, owners and replica balancing, every rank's
  share) and :func:`ucpformat.checkpoint.writer.commit` (node metadata, manifest, root) into a
  scratch directory; then :func:`ucpformat.open` of the result (the open time);
* **before**: what each rank did before the coordinator planned alone: receive every
  rank's description (``allgather``, padded to the longest) and run
  :func:`~ucpformat.distributed.save_plan.plan_from_descriptions` itself, then receive every rank's
  list of written objects;
* **load, one rank** of a target layout: from the opened checkpoint, each tensor's
  layout semantics, the rank's local map (:func:`ucpformat.layout.rank_slices.local_map`,
  flat ZeRO partitions by :func:`ucpformat.layout.zero.flat_partition`) and the shards
  and inner chunks the read touches (:func:`ucpformat.engine.grid.objects_overlapping`,
  :func:`ucpformat.engine.grid.inner_chunk_ranges`, as the reader plans them);
* **DCP**: ``DefaultSavePlanner.create_global_plan`` on the same boxes as ``SavePlan``
  write items (deduplication of replicas included), the pickled ``.metadata`` with a
  ``FileSystemWriter``-style storage index, and ``create_read_items_for_chunk_list``
  (what ``DefaultLoadPlanner.create_local_plan`` runs per tensor) for one target rank.

Times are wall-clock seconds on this machine (one process). One rank's memory is the
tracemalloc peak of its step (a second run: tracing slows it); the coordinator's, the
"before" rank's and DCP's are the growth of the process's peak RSS over the step (a lower
bound: the simulation's own data came first). Bytes per rank count what the collectives
carry besides tensor data: description, share, written-object lists, agreements (the
all-to-all size headers included: 8 bytes per peer).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import pickle
import resource
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import Table
from benchmarks import scale_layouts as L
from ucpformat.checkpoint.commit import commit_checkpoint as commit
from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.distributed.pipeline import plan_shares, take_share
from ucpformat.distributed.rank_description import (
    boxes_off_mesh,
    decode_descriptions,
    describe,
    encode_description,
    encode_own_part,
    encode_shared_part,
)
from ucpformat.distributed.save_plan import Plan, PlanOptions, plan_from_descriptions
from ucpformat.engine.grid import inner_chunk_ranges, objects_overlapping
from ucpformat.engine.write import StoredObject
from ucpformat.layout.boxes import LocalMap, Piece
from ucpformat.layout.rank_slices import ParallelConfig, local_map
from ucpformat.layout.semantics import layout_of
from ucpformat.layout.zero import flat_partition
from ucpformat.store import LocalStore

T = TypeVar("T")
MiB = 1 << 20

#: Data-parallel degrees of the Llama runs (TP 8 x PP 16): 1,024 / 4,096 / 16,384 ranks.
FULL_DP = (8, 32, 128)
QUICK_DP = (1,)
QUICK_LLAMA = dataclasses.replace(L.LLAMA_405B, name="Llama-405B-16L", layers=16)
#: FSDP2 x TP (TP 8): data-parallel degrees of 1,024 / 4,096 / 16,384 ranks, the whole
#: 405B model, each rank describing the DTensors by mesh and placements. DCP sees every
#: rank's boxes (56 M write items for the whole model at 16,384 ranks, beyond one
#: process of this machine in the 15 minutes of the full mode): it plans the same
#: layout on FSDP_DCP_LAYERS layers, beside ours on the same layers.
FULL_FSDP_DP = (128, 512, 2048)
QUICK_FSDP_DP = (16,)
FSDP_DCP_LAYERS = 2
#: The "before" protocol (every rank plans everything) is run for the dense model at every
#: scale, for the others up to this many ranks (it is the coordinator's plan again).
BEFORE_MAX_RANKS = 4096


def measured(fn: Callable[[], T]) -> tuple[T, float, int]:
    """(result, seconds, tracemalloc peak bytes) of ``fn()``: timed in a first run, its
    memory traced in a second (tracing slows allocation-heavy code several times)."""
    gc.collect()
    t = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, elapsed, peak


def rss_growth(fn: Callable[[], T]) -> tuple[T, float, float, int]:
    """(result, seconds, CPU seconds, growth of the process's peak RSS) of ``fn()``, run
    once: for the steps too slow to run twice (a lower bound on their peak memory). The
    CPU time is what to compare on a loaded machine: the wall time grows with the load."""
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t, cpu = time.perf_counter(), time.process_time()
    out = fn()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out, elapsed, cpu, (after - before) * 1024


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


# -- save ----------------------------------------------------------------------------------


def objects_of(plan: Plan) -> list[StoredObject]:
    """What every rank reports having written (sizes as stored uncompressed)."""
    out = []
    for tp in plan.tensors.values():
        meta = tp.meta
        for o in tp.objects:
            n = math.prod(b - a for a, b in o.region) * meta.dtype.itemsize
            out.append(StoredObject(meta.object_key(o.coords), n, None))
    return out


def save_figures(sc: L.Scenario, scratch: Path, *, before: bool) -> dict[str, Any]:
    """Every figure of one simulated save (see the module's doc)."""
    world = sc.world
    cpu = time.process_time()
    ranks, build_s = timed(lambda: list(sc.ranks()))
    # one rank: the rank with the most fragments (the slowest describes the longest); its
    # step 1 as the pipeline runs it (its fragments checked against its mesh places)
    probe = max(ranks, key=lambda r: (len(r.boxes), r.rank))
    probe_boxes = probe.all_boxes()

    def describe_probe() -> tuple[dict[str, Any], bytes]:
        boxes = boxes_off_mesh(probe_boxes, probe.specs, probe.meshes, probe.on_mesh)
        doc = {**describe(probe.specs, boxes, meshes=probe.meshes, on_mesh=probe.on_mesh),
               "error": ""}
        return doc, encode_description(doc)

    (probe_doc, blob), rank_describe_s, rank_describe_peak = measured(describe_probe)
    blobs, encode_s = timed(lambda: encode_all(ranks))
    assert blobs[probe.rank] == blob
    ranks.clear()
    simulate_cpu_s = time.process_time() - cpu
    gc.collect()
    # the coordinator
    store = LocalStore(str(scratch / "ckpt"), durable=False)
    store.delete_all()
    (plan, shares, _, error), coord_plan_s, coord_plan_cpu_s, coord_plan_peak = rss_growth(
        lambda: plan_shares(blobs, PlanOptions(), store, overwrite=True))
    if error is not None or plan is None:
        raise RuntimeError(f"the simulated plan failed: {error}")
    share = shares[probe.rank] if probe.rank else b"{}"
    mine, rank_share_s, rank_share_peak = measured(
        lambda: take_share(share, None if probe.rank else plan, probe.rank, None, probe_doc))
    assert mine.tasks is not None
    written = objects_of(plan)
    per_rank_written = max(len(json.dumps([[o.key, o.nbytes, None] for o in tasks_objects]))
                           for tasks_objects in _objects_by_owner(plan, written))
    root, commit_s, commit_cpu_s, commit_peak = rss_growth(lambda: commit(
        store, arrays=[tp.meta for tp in plan.tensors.values()],
        groups=list(plan.groups.values()), objects=written,
        root_ucp={"producer": {"name": "bench_scale"}}, hash_algorithm=None))
    root_bytes = (scratch / "ckpt" / "zarr.json").stat().st_size
    manifest_bytes = sum(f.stat().st_size for f in (scratch / "ckpt").glob("*manifest*"))
    node_files = sum(1 for _ in (scratch / "ckpt").rglob("zarr.json"))
    ckpt, open_s, open_peak = measured(lambda: open_checkpoint(str(scratch / "ckpt")))
    # bytes per rank in the coordination collectives (tensor data apart)
    agreement = 3 * (8 * world + 2 * world)  # 3 allgathers of empty reports
    sent = len(blob) + 8 * world + per_rank_written + 8 * world + 4 * world
    received = len(share) + 8 * world + agreement + 4 * world
    cells = sum(mine.tasks.send_sizes().values())
    row: dict[str, Any] = {
        "scenario": sc.name, "layout": sc.describe(), "ranks": world,
        "arrays": len(plan.tensors), "objects": len(written),
        "files": len(written) + node_files + 1,
        "build_s": build_s, "encode_all_s": encode_s, "simulate_cpu_s": simulate_cpu_s,
        "rank_save_s": rank_describe_s + rank_share_s,
        "rank_save_peak": max(rank_describe_peak, rank_share_peak),
        "rank_sent": sent, "rank_received": received, "rank_cells": cells,
        "description_bytes": len(blob), "share_bytes": len(share),
        "coord_plan_s": coord_plan_s, "coord_plan_cpu_s": coord_plan_cpu_s,
        "coord_plan_peak": coord_plan_peak,
        "coord_received": sum(len(b) for b in blobs), "coord_sent": sum(map(len, shares.values())),
        "commit_s": commit_s, "commit_cpu_s": commit_cpu_s, "commit_peak": commit_peak,
        "root_bytes": root_bytes, "manifest_bytes": manifest_bytes,
        "moves": plan.move_count(), "open_s": open_s, "open_peak": open_peak,
    }
    del root
    if before:
        descs = decode_descriptions(blobs)
        # the JSON description each rank sent before (boxes listed with their paths)
        raw = [len(json.dumps({"specs": d.specs, "boxes": d.box_list(), "groups": d.groups,
                               "error": d.error}, separators=(",", ":"))) for d in descs]
        (_, before_s, before_cpu_s, before_peak) = rss_growth(
            lambda: plan_from_descriptions(descs, PlanOptions()).tasks(probe.rank))
        written_all = len(json.dumps([[o.key, o.nbytes, None] for o in written]))
        row.update({
            "before_rank_s": before_s, "before_rank_cpu_s": before_cpu_s,
            "before_rank_peak": before_peak,
            # padded allgather of descriptions, then of every rank's written objects
            "before_rank_received": world * max(raw) + world * per_rank_written + 8 * world,
            "before_written_total": written_all,
        })
        del descs
    ckpt_holder.clear()
    ckpt_holder.append(ckpt)
    return row


ckpt_holder: list[Checkpoint] = []


def encode_all(ranks: Sequence[L.SimRank]) -> list[bytes]:
    """Every rank's :func:`~ucpformat.distributed.rank_description.encode_description`, as
    ``encode_shared_part + encode_own_part`` (what the function is): the shared part
    (specs, tensors on meshes) encoded once for the ranks that share those lists, as
    thousands of real ranks would each encode the same bytes."""
    shared: dict[tuple[int, int], bytes] = {}
    out = []
    for r in ranks:
        key = (id(r.specs), id(r.on_mesh))
        if key not in shared:
            shared[key] = encode_shared_part(describe(r.specs, [], on_mesh=r.on_mesh,
                                                      meshes=r.meshes))
        own = {**describe((), r.boxes, meshes=r.meshes), "error": ""}
        out.append(shared[key] + encode_own_part(own))
    return out


def _objects_by_owner(plan: Plan, written: Sequence[StoredObject]) -> list[list[StoredObject]]:
    by_key = {o.key: o for o in written}
    out: dict[int, list[StoredObject]] = {}
    for tp in plan.tensors.values():
        for o in tp.objects:
            out.setdefault(o.owner, []).append(by_key[tp.meta.object_key(o.coords)])
    return list(out.values())


# -- load ----------------------------------------------------------------------------------


def load_figures(ckpt: Checkpoint, model: L.Transformer, cfg: ParallelConfig,
                 label: str, ranks: Sequence[int]) -> dict[str, Any]:
    """One rank's read plan for a target layout (the worst of ``ranks``)."""
    worst: dict[str, Any] = {}
    for rank in ranks:
        (chunks, nbytes, needed, shards), seconds, peak = measured(
            lambda r=rank: read_plan(ckpt, model, cfg, r))  # type: ignore[misc]
        if not worst or seconds > worst["rank_load_s"]:
            worst = {"target": label, "target_ranks": cfg.world, "rank": rank,
                     "rank_load_s": seconds, "rank_load_peak": peak, "chunks": chunks,
                     "read_bytes": nbytes, "needed_bytes": needed, "shards": shards,
                     "amplification": nbytes / needed if needed else 0.0}
    return worst


def read_plan(ckpt: Checkpoint, model: L.Transformer, cfg: ParallelConfig,
              rank: int) -> tuple[int, int, int, int]:
    """What rank ``rank`` of ``cfg`` reads: (inner chunks, their bytes, bytes it needs,
    shards touched). Local maps from the stored layout semantics, as a loader does."""
    c = cfg.coords(rank)
    params = L.megatron_params(model)
    conventions = {p.name: p.conventions for p in params}
    held: list[tuple[str, LocalMap]] = []
    for p in params:
        path = L.model_path(p.name)
        t = ckpt[path]
        m = local_map(t.shape, layout_of(t.attributes, t.shape, tensor=path),
                      conventions[p.name], cfg, c, zero3=False, tensor=path)
        if m is not None:
            held.append((p.name, m))
    reads: list[tuple[str, LocalMap]] = [(L.model_path(n), m) for n, m in held]
    part = flat_partition(held, cfg.dp, c.dp)
    for fp in part.pieces:
        flat = LocalMap((fp.size,), (Piece(((0, fp.size),), fp.glob),))
        reads += [(L.state_path(fp.tensor, s), flat) for s in L.ZERO_STATES]
    chunks = nbytes = needed = 0
    shards: set[tuple[str, tuple[int, ...]]] = set()
    for path, m in reads:
        meta = ckpt[path].meta
        chunk_bytes = math.prod(meta.chunk_shape) * meta.dtype.itemsize
        for piece in m.pieces:
            lo = [a for a, _ in piece.glob]
            hi = [b for _, b in piece.glob]
            needed += math.prod(b - a for a, b in piece.glob) * meta.dtype.itemsize
            for coords in objects_overlapping(meta, lo, hi):
                shards.add((path, coords))
                n = math.prod(len(r) for r in inner_chunk_ranges(meta, coords, lo, hi))
                chunks += n
                nbytes += n * chunk_bytes
    return chunks, nbytes, needed, len(shards)


# -- DCP --------------------------------------------------------------------------------------


def dcp_figures(sc: L.Scenario,
                loads: Sequence[ParallelConfig] = ()) -> tuple[dict[str, Any], list[float]]:
    """DCP's default planners on the same boxes (see the module's doc): the figures of
    the save, and for each of ``loads`` the seconds rank 0 of that target layout plans
    its load from the same ``.metadata`` (built once: at 16,384 ranks the simulated
    save plans are a million write items)."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    props: dict[str, TensorProperties] = {}
    plans = []
    shapes: dict[str, torch.Size] = {}
    t0 = time.perf_counter()
    for r in sc.ranks():
        for s in r.specs:
            if s.path not in shapes:
                shapes[s.path] = torch.Size(s.shape)
                props[s.path] = TensorProperties(dtype=dtypes[s.dtype])
        items = [
            WriteItem(
                index=MetadataIndex(path, torch.Size([a for a, _ in box])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size([a for a, _ in box]),
                                               torch.Size([b - a for a, b in box])),
                    properties=props[path], size=shapes[path]))
            for path, box in r.all_boxes()
        ]
        plans.append(SavePlan(items, planner_data={}))
    build_s = time.perf_counter() - t0
    planner = DefaultSavePlanner()
    (final, metadata), global_s, global_cpu_s, global_peak = rss_growth(
        lambda: planner.create_global_plan(plans))
    plans.clear()
    # FileSystemWriter's finish: every write item's file, offset and length in .metadata
    storage: dict[Any, Any] = {}
    for rank, plan in enumerate(final):
        offset = 0
        for item in plan.items:
            assert item.tensor_data is not None
            n = math.prod(item.tensor_data.chunk.sizes) * (
                2 if item.tensor_data.properties.dtype == torch.bfloat16 else 4)
            storage[item.index] = _StorageInfo(f"__{rank}_0.distcp", offset, n)
            offset += n
    metadata.storage_data = storage
    (pickled, pickle_s) = timed(lambda: pickle.dumps(metadata))
    files = sum(1 for p in final if p.items) + 1
    row: dict[str, Any] = {"dcp_build_s": build_s, "dcp_global_s": global_s,
                           "dcp_global_cpu_s": global_cpu_s,
                           "dcp_global_peak": global_peak, "dcp_metadata_bytes": len(pickled),
                           "dcp_pickle_s": pickle_s, "dcp_files": files,
                           "dcp_items": sum(len(p.items) for p in final)}
    model = sc.model

    def plan_rank(load_cfg: ParallelConfig) -> int:
        c = load_cfg.coords(0)
        md = pickle.loads(pickled)
        count = 0
        for p, m in ((p, local_map(p.shape, p.layout, p.conventions, load_cfg, c,
                                   zero3=False, tensor=p.name))
                     for p in L.megatron_params(model)):
            if m is None:
                continue
            path = L.model_path(p.name)
            chunks = [ChunkStorageMetadata(torch.Size([a for a, _ in pc.glob]),
                                           torch.Size([b - a for a, b in pc.glob]))
                      for pc in m.pieces]
            count += len(create_read_items_for_chunk_list(
                path, md.state_dict_metadata[path], chunks))
            for s in L.ZERO_STATES:  # DCP has no flat partitions: the TP shard of each
                spath = L.state_path(p.name, s)
                count += len(create_read_items_for_chunk_list(
                    spath, md.state_dict_metadata[spath], chunks))
        return count

    load_seconds = []
    for load_cfg in loads:
        (reads, load_s, _, load_peak) = rss_growth(functools.partial(plan_rank, load_cfg))
        load_seconds.append(load_s)
        if len(load_seconds) == 1:
            row.update({"dcp_rank_load_s": load_s, "dcp_rank_load_peak": load_peak,
                        "dcp_rank_read_items": reads})
    return row, load_seconds


# -- the tables ---------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / MiB:.2f}" if n < 100 * MiB else f"{n / MiB:.0f}"


def _s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def run(quick: bool = False, *, dps: Sequence[int] | None = None,
        fsdp_dps: Sequence[int] | None = None,
        moe: bool = True, fsdp: bool = True, dcp: bool = True,
        model: L.Transformer | None = None,
        directory: str | Path | None = None,
        progress: Path | None = None) -> list[Table]:
    """The tables; ``quick``: 128 ranks of a 16-layer Llama-405B-shaped model (one layer
    per stage) and small MoE and FSDP2 runs, instead of 1,024 to 16,384 ranks.
    ``progress``: a JSON file rewritten with the figures after each scenario."""
    dps = tuple(dps or (QUICK_DP if quick else FULL_DP))
    llama = model or (QUICK_LLAMA if quick else L.LLAMA_405B)
    rows: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        scratch = Path(tmp)
        scenarios = [L.megatron(llama, 8, 16, dp) for dp in dps]
        if moe:
            scenarios += [L.megatron(L.MIXTRAL_8X7B, 2, 4, dp * 16, ep=8) for dp in dps]
        if fsdp:
            shallow = dataclasses.replace(llama, name=f"{llama.name}-{FSDP_DCP_LAYERS}L",
                                          layers=FSDP_DCP_LAYERS)
            for dp in fsdp_dps or (QUICK_FSDP_DP if quick else FULL_FSDP_DP):
                scenarios += [L.fsdp2(shallow, dp, 8), L.fsdp2(llama, dp, 8)]
        for sc in scenarios:
            cpu = time.process_time()
            row = save_figures(sc, scratch,
                               before=sc.kind == "megatron" or sc.world <= BEFORE_MAX_RANKS)
            largest = sc.kind == "megatron" and sc is scenarios[len(dps) - 1]
            big = L.load_config(sc.model, 4, 8, max(1, sc.world // 256))
            one_rank = L.load_config(sc.model, 1, 1, 1)
            dcp_loads: list[float] = []
            if dcp and (sc.kind != "fsdp2" or sc.model.layers <= FSDP_DCP_LAYERS):
                targets = [big, one_rank] if largest else [big] if sc.kind == "megatron" else []
                figures, dcp_loads = dcp_figures(sc, targets)
                row.update(figures)
            rows.append(row)
            print(f"  {sc.name}: coordinator {row['coord_plan_s']:.1f} s, rank "
                  f"{row['rank_save_s']:.3f} s", flush=True)
            if largest:
                ckpt = ckpt_holder[0]
                probe = [0, big.world // 2, big.world - 1]
                loads.append(load_figures(ckpt, sc.model, big,
                                          f"TP 4 x PP 8 x DP {big.dp}", probe))
                loads.append(load_figures(ckpt, sc.model, one_rank, "1 rank", [0]))
                for x, seconds in zip(loads[-2:], dcp_loads, strict=False):
                    x["dcp_rank_load_s"] = seconds
            ckpt_holder.clear()
            gc.collect()
            row["scenario_cpu_s"] = time.process_time() - cpu  # the simulation's included
            if progress is not None:
                progress.write_text(json.dumps({"save": rows, "load": loads}, indent=1))
    return tables(rows, loads)


def tables(rows: list[dict[str, Any]], loads: list[dict[str, Any]]) -> list[Table]:
    save = Table(
        "Distributed save at scale: one rank, the coordinator, the metadata (simulated ranks)",
        ["layout", "ranks", "arrays", "shard files", "rank plan s", "rank MiB peak",
         "rank sent KiB", "rank recv KiB", "coordinator s", "coord. MiB peak", "commit s",
         "root MiB", "manifest MiB", "open s"],
        [[r["scenario"].split(" ")[0] + " " + r["layout"], str(r["ranks"]), str(r["arrays"]),
          str(r["objects"]), _s(r["rank_save_s"]), _mib(r["rank_save_peak"]),
          f"{r['rank_sent'] / 1024:.0f}", f"{r['rank_received'] / 1024:.0f}",
          _s(r["coord_plan_s"]), _mib(r["coord_plan_peak"]), _s(r["commit_s"]),
          _mib(r["root_bytes"]), _mib(r["manifest_bytes"]), _s(r["open_s"])] for r in rows],
        ["rank plan: describe + encode + take its share (the rank with most fragments); "
         "coordinator: decode every description, plan, cut every rank's share",
         "sent/recv: bytes a rank moves in the coordination collectives besides tensor data"],
        data={"save": rows, "load": loads},
    )
    before = Table(
        "Before: every rank planned everything (allgather of descriptions and of written lists)",
        ["layout", "ranks", "rank plan s (before)", "rank MiB peak (before)",
         "rank recv MiB (before)", "rank plan s (now)", "rank recv KiB (now)"],
        [[r["scenario"].split(" ")[0] + " " + r["layout"], str(r["ranks"]),
          _s(r["before_rank_s"]), _mib(r["before_rank_peak"]),
          _mib(r["before_rank_received"]), _s(r["rank_save_s"]),
          f"{r['rank_received'] / 1024:.0f}"] for r in rows if "before_rank_s" in r],
    )
    out = [save, before]
    if any("dcp_global_s" in r for r in rows):
        out.append(Table(
            "DCP's default planners on the same state",
            ["layout", "ranks", "ucpformat coordinator s", "DCP global plan s",
             "ucpformat root+manifest MiB", "DCP .metadata MiB (pickle)", "ucpformat files",
             "DCP files", "DCP load plan s (1 rank)"],
            [[r["scenario"].split(" ")[0] + " " + r["layout"], str(r["ranks"]),
              _s(r["coord_plan_s"] + r["commit_s"]), _s(r["dcp_global_s"]),
              _mib(r["root_bytes"] + r["manifest_bytes"]), _mib(r["dcp_metadata_bytes"]),
              str(r["files"]), str(r["dcp_files"]),
              _s(r["dcp_rank_load_s"]) if "dcp_rank_load_s" in r else "-"] for r in rows
             if "dcp_global_s" in r],
            ["DCP load plan: create_read_items_for_chunk_list for every tensor of a "
             "TP 4 x PP 8 target rank (DCP cannot read flat ZeRO partitions: the TP shard)"],
        ))
    if loads:
        out.append(Table(
            "Resharded load from the largest save: one rank's read plan",
            ["target", "ranks", "rank plan s", "rank MiB peak", "shards", "inner chunks",
             "read MiB", "needed MiB", "amplification", "DCP plan s"],
            [[x["target"], str(x["target_ranks"]), _s(x["rank_load_s"]),
              _mib(x["rank_load_peak"]), str(x["shards"]), str(x["chunks"]),
              _mib(x["read_bytes"]), _mib(x["needed_bytes"]), f"{x['amplification']:.3f}",
              _s(x["dcp_rank_load_s"]) if "dcp_rank_load_s" in x else "-"] for x in loads],
        ))
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    """Log-log: each cost of the save against the number of ranks, by model, with DCP's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["save"]
    panels = [
        ("seconds", [("rank_save_s", "one rank's plan"), ("coord_plan_s", "coordinator plan"),
                     ("commit_s", "commit (metadata)"), ("open_s", "open"),
                     ("before_rank_s", "one rank, before"), ("dcp_global_s", "DCP global plan")]),
        ("bytes", [("rank_received", "rank receives"), ("before_rank_received",
                                                          "rank receives, before"),
                   ("root_bytes", "root zarr.json"), ("manifest_bytes", "manifest"),
                   ("dcp_metadata_bytes", "DCP .metadata")]),
        ("peak bytes (one rank: tracemalloc; others: RSS growth)", [
            ("rank_save_peak", "one rank"),
                                    ("coord_plan_peak", "coordinator"),
                                    ("before_rank_peak", "one rank, before")]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    kinds = sorted({r["scenario"].rsplit(" ", 1)[0] for r in rows})
    styles = ["-", "--", ":"]
    for ax, (unit, series) in zip(axes[0], panels, strict=True):
        for ki, kind in enumerate(kinds):
            sel = sorted((r for r in rows if r["scenario"].rsplit(" ", 1)[0] == kind),
                         key=lambda r: r["ranks"])
            if len(sel) < 2:
                continue
            for si, (key, label) in enumerate(series):
                pts = [(r["ranks"], r[key]) for r in sel if r.get(key)]
                if len(pts) >= 2:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], styles[ki % 3],
                            marker="o", color=f"C{si}", label=f"{label} ({kind})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    """``python -m benchmarks.bench_scale [--quick] [--json F] [--plot PNG]``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    tables_out = run(quick=args.quick, progress=args.json)
    for table in tables_out:
        print(table.to_markdown())
    if args.json:
        args.json.write_text(json.dumps(tables_out[0].data, indent=1))
    if args.plot:
        plot(tables_out[0].data, args.plot)


__all__ = ["dcp_figures", "load_figures", "plot", "read_plan", "run", "save_figures", "tables"]

if __name__ == "__main__":
    main()
