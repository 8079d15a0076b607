"""Tensors described on their device mesh (``MeshTensor``), not by every fragment's box.

At thousands of ranks that each hold a piece of every tensor (FSDP2), boxes number ranks
times tensors. A rank instead says where it sits in each mesh and, once for all ranks of
the mesh, each tensor's placements; the coordinator plans each class of alike tensors
once. These tests check that this plans the same checkpoint as the boxes, that what
moves on the wire is small, and that every inconsistency is refused.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from benchmarks import scale_layouts as L
from ucpformat.distributed.rank_description import (
    Description,
    MeshPosition,
    MeshTensor,
    boxes_off_mesh,
    decode_descriptions,
    describe,
    encode_description,
    encode_own_part,
    encode_shared_part,
)
from ucpformat.distributed.save_plan import (
    PlanOptions,
    RankTasks,
    TensorSpec,
    array_meta,
    class_members,
    plan_from_descriptions,
)
from ucpformat.errors import LayoutError, WriteError
from ucpformat.layout.dtensor import Replicate, Shard

TINY = L.Transformer("tiny", layers=3, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48,
                     vocab=40)
FINE = PlanOptions(None, chunk_bytes=256, shard_bytes=2048, min_shard_bytes=1024)


def docs(sc: L.Scenario) -> list[dict[str, Any]]:
    return [describe(r.specs, r.boxes, meshes=r.meshes, on_mesh=r.on_mesh) for r in sc.ranks()]


@pytest.mark.parametrize("options", [FINE, PlanOptions()], ids=["fine", "default"])
@pytest.mark.parametrize("mesh", [(2, 2), (4, 2), (3, 2)])
def test_the_mesh_description_plans_the_same_checkpoint_as_the_boxes(
    mesh: tuple[int, int], options: PlanOptions
) -> None:
    compact = plan_from_descriptions(docs(L.fsdp2(TINY, *mesh)), options)
    boxed = plan_from_descriptions(docs(L.fsdp2(TINY, *mesh, compact=False)), options)
    assert compact.classes and not boxed.classes
    assert {p: t.meta for p, t in compact.tensors.items()} == {
        p: t.meta for p, t in boxed.tensors.items()}
    assert compact.object_keys() == boxed.object_keys()
    assert compact.move_count() == len(compact.transfers())
    # every object is written by a rank that holds it or receives what it lacks
    for path, tp in compact.tensors.items():
        for obj in tp.objects:
            same = next(o for o in boxed.tensors[path].objects if o.coords == obj.coords)
            assert obj.region == same.region
            assert bool(obj.remote) == bool(same.remote), (path, obj.coords)


def test_classes_group_alike_tensors_and_each_rank_expands_its_share() -> None:
    sc = L.fsdp2(TINY, 2, 2)
    described = docs(sc)
    plan = plan_from_descriptions(described, FINE)
    # q, k, v... of every layer, parameter and moments alike: a few classes for 3 x 9 + 3
    # parameters times 3 states
    assert len(plan.tensors) == 90 and len(plan.classes) < 10
    assert sum(len(c.paths) for c in plan.classes) == 90
    compact = plan.all_tasks()
    for rank, tasks in enumerate(compact):
        assert tasks.classes and not tasks.sends  # the moves travel per class
        doc = json.loads(tasks.to_json_bytes({}))
        received = RankTasks.from_json(doc)
        spec_of = {s["path"]: TensorSpec.from_json(s) for s in described[rank]["specs"]}
        received.expand(class_members(spec_of, described[rank]["sharded"]),
                        lambda p, ct, spec_of=spec_of: array_meta(spec_of[p], ct.grid,
                                                                  ct.compression))
        assert received.to_json() == plan.tasks(rank).to_json()


def test_the_coordinator_receives_and_sends_no_box_per_tensor_and_rank() -> None:
    """What differs from rank to rank (its own part, and its share) is a few numbers per
    class of tensors, not a box per tensor; the shared part is the same on every rank."""
    sizes = {}
    for compact in (True, False):
        described = docs(L.fsdp2(TINY, 4, 2, compact=compact))
        shared = {encode_shared_part(d) for d in described}
        own = [len(encode_own_part(d)) for d in described]
        plan = plan_from_descriptions(described, FINE)
        shares = [len(t.to_json_bytes({p: b"{}" for p in t.arrays})) for t in plan.all_tasks()]
        sizes[compact] = (len(shared), max(own), max(shares))
    assert sizes[True][0] == 1
    assert sizes[True][1] < sizes[False][1] / 5
    assert sizes[True][2] < sizes[False][2] / 10


def test_a_description_is_its_shared_part_then_its_own() -> None:
    for r in L.fsdp2(TINY, 2, 2).ranks():
        whole = describe(r.specs, r.boxes, meshes=r.meshes, on_mesh=r.on_mesh)
        shared = encode_shared_part(describe(r.specs, [], on_mesh=r.on_mesh, meshes=r.meshes))
        own = encode_own_part(describe((), r.boxes, meshes=r.meshes))
        assert encode_description(whole) == shared + own
    ranks = list(L.fsdp2(TINY, 2, 2).ranks())
    decoded = decode_descriptions([encode_description(d) for d in docs(L.fsdp2(TINY, 2, 2))])
    # every rank of the mesh sent the same tensors: parsed once
    assert all(d.sharded is decoded[0].sharded for d in decoded)
    assert [d.meshes[L.FSDP_MESH]["coords"] for d in decoded] == [
        list(r.meshes[0].coords) for r in ranks]


# -- refusals -----------------------------------------------------------------------------

SPECS = [TensorSpec(f"model/w{i}", (8, 4), "float32") for i in range(3)]


def rank_doc(coords: tuple[int, ...], *, shape: tuple[int, ...] = (2,), mesh: str = "m",
             tensors: int = 3, placement: Any = None) -> Description:
    return Description.of(describe(
        SPECS, [], meshes=[MeshPosition(mesh, shape, coords)],
        on_mesh=[MeshTensor(s.path, mesh, (placement or Shard(0),)) for s in SPECS[:tensors]]))


def test_a_well_formed_mesh_plans() -> None:
    plan = plan_from_descriptions([rank_doc((0,)), rank_doc((1,))], FINE)
    assert set(plan.tensors) == {s.path for s in SPECS}


@pytest.mark.parametrize("ranks, message", [
    ([rank_doc((0,)), rank_doc((1,), shape=(3,))], "disagree on the shape of mesh"),
    ([rank_doc((0,)), rank_doc((0,))], "both sit at"),
    ([rank_doc((0,), shape=(3,)), rank_doc((1,), shape=(3,))], "every position needs one"),
    ([rank_doc((0,)), rank_doc((1,), tensors=2)], "lay out different tensors"),
    ([rank_doc((0,)), rank_doc((1,), placement=Replicate())], "lay out different tensors"),
])
def test_inconsistent_meshes_are_refused(ranks: list[Description], message: str) -> None:
    with pytest.raises(LayoutError, match=message) as info:
        plan_from_descriptions(ranks, FINE)
    assert info.value.rule in ("UCP-1.0-R114", "UCP-1.0-R131")


def test_a_tensor_on_a_mesh_and_in_boxes_is_refused() -> None:
    boxed = Description.of(describe(SPECS, [("model/w0", ((0, 8), (0, 4)))]))
    with pytest.raises(LayoutError, match="both by fragments and on a mesh") as info:
        plan_from_descriptions([rank_doc((0,)), rank_doc((1,)), boxed], FINE)
    assert info.value.tensor == "model/w0"


def test_a_tensor_on_two_meshes_is_refused() -> None:
    a = [rank_doc((i,), mesh="a") for i in range(2)]
    b = [rank_doc((i,), mesh="b") for i in range(2)]
    with pytest.raises(LayoutError, match="on mesh 'a' and on mesh 'b'"):
        plan_from_descriptions(a + b, FINE)


def test_describe_refuses_what_it_cannot_vouch_for() -> None:
    with pytest.raises(LayoutError, match="no place in mesh"):
        describe(SPECS, [], on_mesh=[MeshTensor("model/w0", "m", (Shard(0),))])
    with pytest.raises(LayoutError, match="has no spec"):
        describe((), [], meshes=[MeshPosition("m", (2,), (0,))],
                 on_mesh=[MeshTensor("model/w0", "m", (Shard(0),))])
    with pytest.raises(LayoutError, match="outside mesh"):
        describe(SPECS, [], meshes=[MeshPosition("m", (2,), (2,))])
    with pytest.raises(LayoutError, match="placements on mesh"):
        describe(SPECS, [], meshes=[MeshPosition("m", (2,), (0,))],
                 on_mesh=[MeshTensor("model/w0", "m", (Shard(0), Shard(1)))])


def test_fragments_that_are_not_the_mesh_part_are_refused() -> None:
    place = [MeshPosition("m", (2,), (1,))]
    on_mesh = [MeshTensor("model/w0", "m", (Shard(0),))]
    mine = [("model/w0", ((4, 8), (0, 4))), ("model/w1", ((0, 8), (0, 4)))]
    assert boxes_off_mesh(mine, SPECS, place, on_mesh) == mine[1:]
    with pytest.raises(LayoutError, match="not its part") as info:
        boxes_off_mesh([("model/w0", ((0, 4), (0, 4)))], SPECS, place, on_mesh)
    assert info.value.tensor == "model/w0" and info.value.rule == "UCP-1.0-R114"
    with pytest.raises(LayoutError, match="not its part"):
        boxes_off_mesh([], SPECS, place, on_mesh)  # a fragment missing


def test_a_rank_that_knows_other_members_than_the_coordinator_refuses_its_share() -> None:
    plan = plan_from_descriptions([rank_doc((0,)), rank_doc((1,))], FINE)
    tasks = plan.all_tasks()[1]
    spec_of = {s.path: s for s in SPECS}
    with pytest.raises(WriteError, match="planned 3 tensors"):
        tasks.expand({}, lambda p, ct: array_meta(spec_of[p], ct.grid, ct.compression))


def test_replicated_tensors_on_a_mesh_spread_their_writers() -> None:
    """Tensors every rank holds whole: each member's writer is balanced on its own (one
    plan for the class must not make one rank write them all)."""
    ranks = [Description.of(describe(
        SPECS, [], meshes=[MeshPosition("dp", (3,), (r,))],
        on_mesh=[MeshTensor(s.path, "dp", (Replicate(),)) for s in SPECS])) for r in range(3)]
    plan = plan_from_descriptions(ranks, FINE)
    assert len(plan.classes) == 1
    writers = {o.owner for tp in plan.tensors.values() for o in tp.objects}
    assert writers == {0, 1, 2}


def test_an_empty_fragment_of_a_tensor_on_a_mesh_is_no_difference() -> None:
    """torch.chunk semantics leave the last positions empty pieces; a caller may list
    them: they hold nothing, as the mesh's parts say."""
    specs = [TensorSpec("model/w", (1, 4), "float32")]
    on_mesh = [MeshTensor("model/w", "m", (Shard(0),))]
    empty = [("model/w", ((1, 1), (0, 4)))]
    assert boxes_off_mesh(empty, specs, [MeshPosition("m", (2,), (1,))], on_mesh) == []


def test_refusals_name_the_tensor_that_differs() -> None:
    fewer = rank_doc((1,), tensors=2)
    with pytest.raises(LayoutError, match="differing: \\['model/w2'\\]") as info:
        plan_from_descriptions([rank_doc((0,)), fewer], FINE)
    assert info.value.tensor == "model/w2"
    twice = [Description.of(describe(
        SPECS, [], meshes=[MeshPosition("m", (1,), (0,))],
        on_mesh=[MeshTensor("model/w0", "m", (Shard(0),))] * 2))]
    with pytest.raises(LayoutError, match="listed twice on mesh 'm'"):
        plan_from_descriptions(twice, FINE)


def test_no_minimum_shard_size_plans_one_shard_per_piece() -> None:
    """min_shard_bytes=0: no minimum (every piece may be its own shard), as the DCP
    plugin already read it."""
    plan = plan_from_descriptions(docs(L.fsdp2(TINY, 2, 2)),
                                  PlanOptions(None, 256, 2048, min_shard_bytes=0))
    assert plan.move_count() == 0
