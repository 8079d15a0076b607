"""The DCP storage plugin: torch.distributed.checkpoint saves and loads UCP checkpoints.

Single-process tests run DCP without a process group. The multi-process tests (marked
``distributed``) run two launches of tests/torch/dcp_worker.py on gloo: 2 ranks save
(FSDP2, TP, an injected failure, and load a ``ucpformat.torch.save`` checkpoint into
FSDP2), then 4 ranks load the FSDP2 checkpoint with DCP's default planners resharding.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_state_dict,
    set_state_dict,
)

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from tests.helpers import launch_ranks  # noqa: E402
from ucpformat.errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidValueError,
)
from ucpformat.torch.dcp import UCPReader, UCPWriter  # noqa: E402
from ucpformat.torch.dcp_keys import (  # noqa: E402
    KeyMap,
    SaveContext,
    ValueTarget,
    assemble_values,
    locate,
)

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

REPO = Path(__file__).resolve().parents[2]


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, x: Any) -> Any:
        return self.norm(self.fc2(torch.relu(self.fc1(x))))


def trained(seed: int, dtype: Any = None) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = MLP()
    if dtype is not None:
        model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    model(torch.randn(4, 6, dtype=dtype)).float().square().sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def assert_same_training_state(a: tuple[Any, Any], b: tuple[Any, Any]) -> None:
    (ma, oa), (mb, ob) = a, b
    for (ka, ta), (kb, tb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert ka == kb and ta.dtype == tb.dtype and torch.equal(ta, tb), ka
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, states in sa["state"].items():
        for name, value in states.items():
            assert torch.equal(value, sb["state"][pid][name]), (pid, name)


def dcp_state(model: Any, opt: Any, **extra: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, **extra}


def load_into(model: Any, opt: Any, reader: UCPReader, **extra: Any) -> dict[str, Any]:
    sd = dcp_state(model, opt, **extra)
    dcp.load(sd, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd


# -- single process -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_round_trip_model_and_adam_bit_exact(tmp_path: Path, dtype: Any) -> None:
    saved = trained(0, dtype)
    dcp.save(dcp_state(*saved, step=12), storage_writer=UCPWriter(tmp_path / "ckpt"))

    fresh = trained(1, dtype)
    sd = load_into(*fresh, UCPReader(tmp_path / "ckpt"), step=0)
    assert sd["step"] == 12
    assert_same_training_state(saved, fresh)
    assert isinstance(fresh[1].state_dict()["param_groups"][0]["betas"], tuple)


def test_tensor_hyperparameters_are_stored_as_numbers(tmp_path: Path) -> None:
    def build(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = MLP()
        opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01 * (seed + 1)))
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        return model, opt

    saved = build(0)
    dcp.save(dcp_state(*saved), storage_writer=UCPWriter(tmp_path / "ckpt", durable=False))
    assert not ucpformat.validate(tmp_path / "ckpt", deep=True).issues
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ckpt.values("optimizer")["param_groups"][0]["lr"] == pytest.approx(0.01)
    assert not any("param_groups" in p for p in ckpt)
    fresh = build(1)
    load_into(*fresh, UCPReader(tmp_path / "ckpt"))
    lr = fresh[1].param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and torch.equal(lr, torch.tensor(0.01))
    assert_same_training_state(saved, fresh)


def test_layout_is_a_plain_ucp_checkpoint(tmp_path: Path) -> None:
    model, opt = trained(0)
    sched = {"last_epoch": 3, "best": float("inf"), "milestones": [1, 2]}
    dcp.save(dcp_state(model, opt, step=5, scheduler=sched),
             storage_writer=UCPWriter(tmp_path / "ckpt", metadata={"run": "a"}, optimizer=opt))
    report = ucpformat.validate(tmp_path / "ckpt", deep=True)
    assert not report.issues, report
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ckpt.metadata == {"run": "a"}
    for fqn, tensor in model.state_dict().items():
        stored = ckpt.tensor("model", fqn)
        assert stored.attributes["role"] == "parameter"
        np.testing.assert_array_equal(stored.read(), tensor.numpy())
    for pid, states in opt.state_dict()["state"].items():
        fqn = list(model.state_dict())[pid]
        for name, value in states.items():
            stored = ckpt.tensor("optimizer", "state", fqn, name)
            assert stored.attributes["role"] == "optimizer_state"
            np.testing.assert_array_equal(stored.read(), value.numpy())
    assert ckpt.values("optimizer")["type"] == "torch.optim.adamw.AdamW"
    groups = ckpt.values("optimizer")["param_groups"]
    assert groups[0]["params"] == list(model.state_dict())
    assert groups[0]["betas"] == [0.8, 0.9] and groups[0]["lr"] == 1e-2
    assert ckpt.values("training") == {"step": 5, "scheduler": sched}
    # what ucpformat.torch reads back is the same training state
    again = trained(2)
    ucpt.load(tmp_path / "ckpt", model=again[0], optimizer=again[1])
    assert_same_training_state((model, opt), again)


def test_roles_and_loading_without_a_model(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    state = dcp_state(model, opt)
    dcp.save(state, storage_writer=UCPWriter(tmp_path / "a", model=torch.nn.DataParallel(model)))
    dcp.save(state, storage_writer=UCPWriter(tmp_path / "b"))
    a, b = ucpformat.open(tmp_path / "a"), ucpformat.open(tmp_path / "b")
    assert a["model/1.running_mean"].attributes["role"] == "buffer"
    assert a["model/0.weight"].attributes["role"] == "parameter"
    assert "role" not in b["model/1.running_mean"].attributes  # DCP does not say
    assert b["model/0.weight"].attributes["role"] == "parameter"  # named by param_groups
    # DCP's "load everything" planner rebuilds the nested state from our planner_data
    everything = _load_state_dict_from_keys(storage_reader=UCPReader(tmp_path / "a"))
    assert everything.keys() == {"model", "optim"}
    for fqn, tensor in model.state_dict().items():
        assert torch.equal(everything["model"][fqn], tensor), fqn
    assert everything["optim"]["param_groups"][0]["momentum"] == 0.9


def test_readable_by_tensorstore(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    model, opt = trained(0, torch.bfloat16)
    dcp.save(dcp_state(model, opt), storage_writer=UCPWriter(tmp_path / "ckpt"))
    store = ts.open({"driver": "zarr3",
                     "kvstore": {"driver": "file",
                                 "path": str(tmp_path / "ckpt" / "model" / "fc1.weight")}}).result()
    got = store.read().result()
    want = ucpt.to_numpy(model.state_dict()["fc1.weight"])
    assert got.dtype.name == "bfloat16"
    assert got.tobytes() == want.tobytes()


def test_checkpoint_id_and_overwrite(tmp_path: Path) -> None:
    model, opt = trained(0)
    path = tmp_path / "ckpt"
    dcp.save(dcp_state(model, opt), checkpoint_id=path, storage_writer=UCPWriter())
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save(dcp_state(model, opt), checkpoint_id=path, storage_writer=UCPWriter())
    assert ucpformat.open(path)  # still committed
    other = trained(3)
    dcp.save(dcp_state(*other), checkpoint_id=path, storage_writer=UCPWriter(overwrite=True))
    fresh = trained(4)
    sd = dcp_state(*fresh)
    dcp.load(sd, checkpoint_id=path, storage_reader=UCPReader())
    set_state_dict(*fresh, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_same_training_state(other, fresh)
    assert ucpt.dcp.UCPWriter is UCPWriter  # reachable as ucpformat.torch.dcp, lazily
    assert UCPReader.validate_checkpoint_id(path)
    assert not UCPReader.validate_checkpoint_id(tmp_path / "nothing")
    assert issubclass(CheckpointExistsError, FileExistsError)


def test_non_json_value_is_refused_by_key_and_nothing_committed(tmp_path: Path) -> None:
    model, opt = trained(0)
    state = dcp_state(model, opt, extra={"handle": object()})
    with pytest.raises(BaseException, match=r"extra\.handle.*never stores pickles") as info:
        dcp.save(state, storage_writer=UCPWriter(tmp_path / "ckpt"))
    assert "object" in str(info.value)
    with pytest.raises(CheckpointNotFoundError):  # the marker withdrawn, nothing left (R049)
        ucpformat.open(tmp_path / "ckpt")
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if not p.is_dir()]
    assert not any(p.name.endswith(".pkl") or p.suffix == ".distcp"
                   for p in (tmp_path / "ckpt").rglob("*"))


def test_optimizer_state_keyed_by_integer_ids_is_refused(tmp_path: Path) -> None:
    model, opt = trained(0)
    with pytest.raises(BaseException, match="get_state_dict"):
        dcp.save({"model": model.state_dict(), "optim": {"param_groups": opt.state_dict()[
            "param_groups"]}}, storage_writer=UCPWriter(tmp_path / "ckpt", durable=False))
    with pytest.raises(BaseException, match="names parameters by FQN"):
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_writer=UCPWriter(tmp_path / "ckpt2", durable=False))
    with pytest.raises(CheckpointNotFoundError):  # the marker withdrawn, nothing left (R049)
        ucpformat.open(tmp_path / "ckpt2")
    assert not [p for p in (tmp_path / "ckpt2").rglob("*") if not p.is_dir()]


def test_bytes_are_stored_as_uint8_arrays(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 3
    state = {"model": {"w": torch.arange(6.0)},
             "dataloader": {"dp_rank_0": blob, "world_size": 2},
             "losses": io.BytesIO(b"raw bytes")}
    dcp.save(state, storage_writer=UCPWriter(tmp_path / "ckpt"))
    ckpt = ucpformat.open(tmp_path / "ckpt")
    stored = ckpt["training/dataloader/dp_rank_0"]
    assert stored.dtype == np.uint8 and stored.read().tobytes() == blob
    assert ckpt.values("training/dataloader") == {"world_size": 2}
    target = {"model": {"w": torch.zeros(6)}, "dataloader": {"dp_rank_0": b"", "world_size": 0},
              "losses": io.BytesIO()}
    dcp.load(target, storage_reader=UCPReader(tmp_path / "ckpt"))
    assert target["dataloader"] == {"dp_rank_0": blob, "world_size": 2}
    assert target["losses"].getvalue() == b"raw bytes"
    assert torch.equal(target["model"]["w"], torch.arange(6.0))


def test_flat_state_dict_and_app_wrapper(tmp_path: Path) -> None:
    # dcp.save(model.state_dict()): FQNs at the top level are model tensors
    model, opt = trained(0)
    dcp.save(model.state_dict(), storage_writer=UCPWriter(tmp_path / "flat"))
    assert "model/fc1.weight" in ucpformat.open(tmp_path / "flat")
    # the DCP tutorial's {"app": AppState}: the wrapper key is looked through
    dcp.save({"app": dcp_state(model, opt)}, storage_writer=UCPWriter(tmp_path / "app"))
    ckpt = ucpformat.open(tmp_path / "app")
    assert "optimizer/state/fc1.weight/exp_avg" in ckpt and "model/fc2.bias" in ckpt
    fresh = trained(5)
    target = {"app": dcp_state(*fresh)}
    dcp.load(target, storage_reader=UCPReader(tmp_path / "app"))
    set_state_dict(*fresh, model_state_dict=target["app"]["model"],
                   optim_state_dict=target["app"]["optim"])
    assert_same_training_state((model, opt), fresh)


def test_torchtitan_style_keys(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    def titan_state(model: Any, opt: Any) -> dict[str, Any]:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        state: dict[str, Any] = dict(get_model_state_dict(model))
        state["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
        state["lr_scheduler"] = {"last_epoch": 9, "base_lrs": [0.01]}
        state["train_state"] = {"step": torch.tensor(9, dtype=torch.int32)}
        return state

    model, opt = trained(0)
    dcp.save(titan_state(model, opt), storage_writer=UCPWriter(tmp_path / "ckpt"))
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).issues == []
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert "model/fc1.weight" in ckpt and "optimizer/state/fc1.weight/exp_avg_sq" in ckpt
    groups = ckpt.values("optimizer")["param_groups"]
    assert len(groups) == 1 and groups[0]["params"] == list(model.state_dict())
    assert "training/train_state/step" in ckpt
    fresh = trained(6)
    target = titan_state(*fresh)
    dcp.load(target, storage_reader=UCPReader(tmp_path / "ckpt"))
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    fresh[0].load_state_dict({k: v for k, v in target.items() if k in fresh[0].state_dict()})
    set_optimizer_state_dict(fresh[0], fresh[1], target["optimizer"],
                             options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert_same_training_state((model, opt), fresh)
    # a checkpoint of ucpformat.torch.save loads into the same layout with KeyMap.torchtitan()
    ucpt.save(tmp_path / "single", model=model, optimizer=opt, step=9)
    other = trained(7)
    target = titan_state(*other)
    target.pop("lr_scheduler"), target.pop("train_state")
    dcp.load(target, storage_reader=UCPReader(tmp_path / "single", key_map=KeyMap.torchtitan()))
    other[0].load_state_dict({k: v for k, v in target.items() if k != "optimizer"})
    set_optimizer_state_dict(other[0], other[1], target["optimizer"],
                             options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert_same_training_state((model, opt), other)


def test_single_process_checkpoint_loads_through_reader(tmp_path: Path) -> None:
    model, opt = trained(0)
    ucpt.save(tmp_path / "ckpt", model=model, optimizer=opt, step=4)
    fresh = trained(1)
    sd = load_into(*fresh, UCPReader(tmp_path / "ckpt"), step=0)
    assert sd["step"] == 4
    assert_same_training_state((model, opt), fresh)


def test_reader_reads_only_the_requested_region(tmp_path: Path) -> None:
    big = torch.arange(256 * 1024, dtype=torch.float32).reshape(1024, 256)
    dcp.save({"model": {"w": big}},
             storage_writer=UCPWriter(tmp_path / "ckpt", chunk_bytes=64 << 10))
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    reader = UCPReader(tmp_path / "ckpt")
    md = reader.read_metadata()
    assert md.state_dict_metadata["model.w"].size == big.shape
    reader.set_up_storage_reader(md, True)
    out = torch.zeros(128, 256)

    class Planner:
        def resolve_tensor(self, item: ReadItem) -> Any:
            return out

        def commit_tensor(self, item: ReadItem, tensor: Any) -> None:
            pass

    item = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex("model.w"),
                    dest_offsets=torch.Size([0, 0]),
                    storage_index=MetadataIndex("model.w", [0, 0]),
                    storage_offsets=torch.Size([512, 0]), lengths=torch.Size([128, 256]))
    reader.read_data(LoadPlan([item]), Planner()).wait()  # type: ignore[arg-type]
    assert torch.equal(out, big[512:640])
    assert reader.checkpoint.stats.bytes_read < big.numel() * 4 // 4


# -- the coordinator's plan, with ranks simulated in one process ---------------------------


def _shard_items(fqn: str, full: Any, rows: list[tuple[int, int]]) -> list[Any]:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = []
    for a, b in rows:
        offsets = torch.Size([a, *([0] * (full.dim() - 1))])
        sizes = torch.Size([b - a, *full.shape[1:]])
        items.append(WriteItem(
            index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes),
                                        TensorProperties(dtype=full.dtype), full.shape)))
    return items


class _Planner:
    """resolve_data of one simulated rank: the rows of the full tensor its item names."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def resolve_data(self, item: Any) -> Any:
        chunk = item.tensor_data.chunk
        return self.tensors[item.index.fqn][chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]]

    def lookup_object(self, index: Any) -> Any:
        return {"lr": 0.5, "params": ["w", "b"]}[index.fqn.rpartition(".")[2]]


def _simulate(path: Path, layout: dict[str, list[list[tuple[int, int]]]], tensors: dict[str, Any],
              *, drop_rank: int | None = None) -> list[set[str]]:
    """Run UCPWriter's calls as DCP would for len(layout[...]) ranks; object keys per rank."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

    world = len(next(iter(layout.values())))
    writers = [UCPWriter(path, min_shard_bytes=0, durable=False) for _ in range(world)]
    plans = []
    for rank, writer in enumerate(writers):
        writer.set_up_storage_writer(rank == 0, rank=rank)
        items = [it for fqn, per_rank in layout.items()
                 for it in _shard_items(fqn, tensors[fqn], per_rank[rank])]
        mapping: dict[str, tuple[Any, ...]] = {k: tuple(k.split(".", 1)) for k in layout}
        for name in ("lr", "params"):
            key = f"optim.param_groups.0.{name}"
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            mapping[key] = ("optim", "param_groups", 0, name)
        plans.append(writer.prepare_local_plan(SavePlan(items, planner_data=mapping)))
    plans = writers[0].prepare_global_plan(plans)
    results = [w.write_data(p, _Planner(tensors)).value() for w, p in zip(writers, plans,
                                                                            strict=True)]
    written = [{k for r in rr for k, _, _ in (r.storage_data or {}).get("objects", [])}
               for rr in results]
    if drop_rank is not None:
        results[drop_rank] = []
    writers[0].finish(Metadata({}), results)
    return written


def test_uneven_and_empty_chunks_one_writer_per_shard(tmp_path: Path) -> None:
    tensors = {"model.w": torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4),
               "model.b": torch.arange(7, dtype=torch.float32)}
    layout = {  # FSDP2-like on 4 ranks: 2/2/1/0 rows and 2/2/2/1
        "model.w": [[(0, 2)], [(2, 4)], [(4, 5)], [(5, 5)]],
        "model.b": [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 7)]],
    }
    written = _simulate(tmp_path / "ckpt", layout, tensors)
    assert sum(len(w) for w in written) == len(set().union(*written))  # disjoint
    assert written[3] == {"model/b/c/3"}
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ckpt.arrays["model/w"].object_shape == (2, 4)  # rows 0-2, 2-4, 4-5: one per chunk
    for fqn, tensor in tensors.items():
        np.testing.assert_array_equal(ckpt[fqn.replace(".", "/", 1)].read(), tensor.numpy())
    assert ckpt.values("optimizer") == {"param_groups": [{"lr": 0.5, "params": ["w", "b"]}]}
    assert not ucpformat.validate(tmp_path / "ckpt", deep=True).issues


def test_a_missing_shard_is_never_committed(tmp_path: Path) -> None:
    from ucpformat.errors import WriteError

    tensors = {"model.w": torch.ones(4, 2)}
    with pytest.raises(WriteError, match="planned shards were not written"):
        _simulate(tmp_path / "ckpt", {"model.w": [[(0, 2)], [(2, 4)]], "model.b": [[], []]},
                  {**tensors, "model.b": torch.ones(0)}, drop_rank=1)
    with pytest.raises(CheckpointNotFoundError):  # what was written is removed (R049)
        ucpformat.open(tmp_path / "ckpt")
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if not p.is_dir()]


# -- the key mapping ------------------------------------------------------------------------


def test_key_mapping_table() -> None:
    ctx = SaveContext.of([("model", "a.b"), ("optim", "state", "a.b", "exp_avg")], KeyMap())
    assert locate(("model", "a.b"), tensor=True, ctx=ctx).logical == ("model", "a.b")
    assert locate(("optim", "state", "a.b", "exp_avg"), tensor=True, ctx=ctx).logical == (
        "optimizer", "state", "a.b", "exp_avg")
    assert locate(("optimizer", "param_groups", 0, "lr"), tensor=False, ctx=ctx).logical == (
        "optimizer", "param_groups", 0, "lr")
    # a scheduler under either key is training/scheduler, where ucpformat.torch.load finds it
    assert locate(("lr_scheduler", "last_epoch"), tensor=False, ctx=ctx).logical == (
        "training", "scheduler", "last_epoch")
    assert locate(("scheduler", "last_epoch"), tensor=False, ctx=ctx).logical == (
        "training", "scheduler", "last_epoch")
    assert locate(("data", "epoch"), tensor=False, ctx=ctx).logical == (
        "training", "data", "epoch")
    assert locate(("training", "step"), tensor=False, ctx=ctx).logical == ("training", "step")
    assert locate(("step",), tensor=True, ctx=ctx).logical == ("training", "step")
    # flattened optimizer: the longest known parameter name wins over the last dot
    flat = SaveContext.of([("w.x",), ("optimizer", "param_groups.w.x.lr")], KeyMap())
    assert flat.top_level_model
    assert locate(("w.x",), tensor=True, ctx=flat).logical == ("model", "w.x")
    assert locate(("optimizer", "state.w.x.nested.m"), tensor=True, ctx=flat).logical == (
        "optimizer", "state", "w.x", "nested.m")
    assert locate(("optimizer", "param_groups.w.x.lr"), tensor=False,
                  ctx=flat).param_entry == ("w.x", "lr")
    with pytest.raises(InvalidValueError, match=r"optim\.state\.p"):
        locate(("optim", "state", "p"), tensor=True, ctx=ctx)


def test_values_go_to_the_deepest_group() -> None:
    groups = {"training", "training/loader"}
    values = [
        (("loader", "world"), ValueTarget(("training", "loader", "world")), 2),
        (("sched", "epoch"), ValueTarget(("training", "sched", "epoch")), 3),
        (("opt", "param_groups.a.lr"), ValueTarget(param_entry=("a", "lr")), 0.1),
        (("opt", "param_groups.b.lr"), ValueTarget(param_entry=("b", "lr")), 0.1),
        (("opt", "param_groups.c.lr"), ValueTarget(param_entry=("c", "lr")), 0.2),
    ]
    group_values, entries = assemble_values(values, groups)
    assert group_values["training/loader"] == {"world": 2}
    assert group_values["training"] == {"sched": {"epoch": 3}}
    assert group_values["optimizer"] == {"param_groups": [
        {"params": ["a", "b"], "lr": 0.1}, {"params": ["c"], "lr": 0.2}]}
    assert entries["opt.param_groups.b.lr"].pointer == ("param_groups", 0, "lr")
    assert entries["sched.epoch"].group == "training"


# -- several processes ---------------------------------------------------------------------


def _launch(scenario: str, root: Path, world: int, timeout: float = 240) -> None:
    """Run ``world`` ranks of the worker; their output goes to files (a full pipe blocks)."""
    launch_ranks("tests.torch.dcp_worker", [scenario, str(root)], root, world, scenario,
                 timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """2 ranks save, then 4 ranks load; the checkpoints and results live in one directory."""
    root = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(3)
        model = MLP()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        ucpt.save(root / "single", model=model, optimizer=opt, step=7)
    _launch("save", root, 2)
    _launch("load", root, 4)
    yield root


def _npz(path: Path) -> dict[str, np.ndarray[Any, Any]]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp", "fsdp_aligned"])
def test_fsdp2_checkpoint_is_consolidated(runs: Path, name: str) -> None:
    report = ucpformat.validate(runs / name, deep=True)
    assert not report.issues, report
    reference = _npz(runs / "fsdp_reference.npz")
    ckpt = ucpformat.open(runs / name)
    assert ckpt.ucp["saved_by"]["world_size"] == 2
    for path, want in reference.items():
        got = ckpt[path].read()
        assert got.dtype == want.dtype and np.array_equal(got, want), path
    shards = ckpt.arrays["model/fc1.weight"].object_shape
    # aligned: 10 rows as the 2 ranks' FSDP2 chunks (5 + 5); default: one shard, whose
    # owner received the other rank's rows
    assert shards == ((5, 6) if name == "fsdp_aligned" else (10, 6))


@pytest.mark.distributed
def test_fsdp2_two_ranks_to_four_ranks(runs: Path) -> None:
    reference = _npz(runs / "fsdp_reference.npz")
    loaded = _npz(runs / "fsdp_loaded4.npz")
    assert reference.keys() == loaded.keys()
    for path, want in reference.items():
        assert np.array_equal(loaded[path], want), path
    result = json.loads((runs / "load.json").read_text())
    assert result["step"] == 1
    assert len(result["bytes_read"]) == 4


@pytest.mark.distributed
def test_tensor_parallel_two_ranks_to_one(runs: Path) -> None:
    assert ucpformat.validate(runs / "tp", deep=True).issues == []
    reference = _npz(runs / "tp_reference.npz")
    ckpt = ucpformat.open(runs / "tp")
    for path, want in reference.items():
        assert np.array_equal(ckpt[path].read(), want), path
    torch.manual_seed(11)
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    load_into(model, opt, UCPReader(runs / "tp"))
    for fqn, tensor in model.state_dict().items():
        assert np.array_equal(tensor.numpy(), reference[f"model/{fqn}"]), fqn
    names = list(model.state_dict())
    for pid, states in opt.state_dict()["state"].items():
        for state, value in states.items():
            want = reference[f"optimizer/state/{names[pid]}/{state}"]
            assert np.array_equal(value.numpy(), want), (names[pid], state)


@pytest.mark.distributed
def test_single_process_checkpoint_into_fsdp2(runs: Path) -> None:
    loaded = _npz(runs / "single_loaded.npz")
    single = ucpformat.open(runs / "single")
    assert loaded and set(loaded) <= set(single.keys())
    for path, got in loaded.items():
        assert np.array_equal(single[path].read(), got), path
    result = json.loads((runs / "save.json").read_text())
    assert result["single_param_groups"][0]["lr"] == 3e-3


@pytest.mark.distributed
def test_failure_in_one_rank_commits_nothing(runs: Path) -> None:
    result = json.loads((runs / "save.json").read_text())
    assert result["failure_raised"]
    assert "injected: no space left on device" in result["failure_message"]
    assert not (runs / "failed" / "zarr.json").exists()
    # the remains of the failed save were refused (R051) until the coordinator's writer
    # was reset, which removed every file of them (R049)
    assert result["failed_refused_with"] == "UCP-1.0-R051"
    assert result["failed_files_after_reset"] == []
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
        ucpformat.open(runs / "failed")


@pytest.mark.distributed
def test_a_rank_failing_mid_exchange_commits_nothing_and_keeps_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    """Rank 1's tensors become unreadable after DCP planned, while rank 0 expects cells
    from it: no rank hangs (the launch's time limit), every rank raises, nothing is
    committed, and the checkpoint being replaced (overwrite=True) is untouched."""
    _launch("exchange_failure", tmp_path, 2, timeout=120)
    outcomes = json.loads((tmp_path / "exchange_failure.json").read_text())["outcomes"]
    assert [o["raised"] for o in outcomes] == [True, True]
    assert all("injected: this rank's tensor could not be read" in o["message"]
               for o in outcomes)
    before = json.loads((tmp_path / "replaced_files.json").read_text())
    after = {str(p.relative_to(tmp_path / "replaced")): p.read_bytes().hex()
             for p in sorted((tmp_path / "replaced").rglob("*")) if p.is_file()}
    assert after == before  # not a file added, removed or changed
    reference = _npz(tmp_path / "replaced_reference.npz")
    ckpt = ucpformat.open(tmp_path / "replaced")
    for path, want in reference.items():
        assert np.array_equal(ckpt[path].read(), want), path

