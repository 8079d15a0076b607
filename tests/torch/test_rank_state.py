"""Per-rank state in distributed saves (spec UCP-1.0-R086, UCP-1.0-R087): each rank's own
generators and data-loader state, saved by ``save_distributed`` and given back to the same
rank by ``load_distributed`` at the same and at another world size."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from tests.torch import rank_state_workers as w  # noqa: E402
from ucpformat.checkpoint.rank_state import RankStateWarning  # noqa: E402
from ucpformat.errors import KeyMismatchError  # noqa: E402
from ucpformat.torch.launch import spawn  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with gloo"),
]


def test_each_rank_gets_its_own_state_back_at_any_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = spawn(w.save, 2, path, timeout=240)
    assert saved[0]["after"] != saved[1]["after"]  # the ranks' streams differ

    ckpt = ucpformat.open(path)
    assert ckpt.values("training/ranks") == {"world_size": 2}
    assert ckpt.values("training/ranks/0/loader") == {"position": 3, "seed": 0}
    assert ckpt.values("training/ranks/1/loader") == {"position": 4, "seed": 10}
    assert ckpt["training/ranks/1/loader/order"].read().tolist() == [10, 11, 12, 13]
    assert "training/ranks/1/rng/torch_cpu" in ckpt.arrays
    report = ucpformat.validate(path, deep=True)
    assert not report.issues, report.issues

    same = spawn(w.load, 2, path, timeout=240)
    for rank in range(2):
        assert same[rank]["after"] == saved[rank]["after"]  # the streams go on exactly
        assert same[rank]["loader"] == [3 + rank, 10 * rank]
        assert same[rank]["notes"] == [] and same[rank]["warnings"] == []
        assert same[rank]["saved_world_size"] == 2
        assert same[rank]["stored"] == ["loader", "rng"] and same[rank]["step"] == 5
        assert "ranks" not in same[rank]["training"]  # no rank reads another's state

    more = spawn(w.load, 3, path, timeout=240)
    for rank in range(2):  # ranks 0 and 1 take their own, and are told the size changed
        assert more[rank]["after"] == saved[rank]["after"]
        assert more[rank]["loader"] == [3 + rank, 10 * rank]
        assert len(more[rank]["notes"]) == 1 and "2 processes" in more[rank]["notes"][0]
        assert more[rank]["warnings"] == more[rank]["notes"]
    lone = more[2]  # rank 2 has none: its generators and loader stay as they were
    assert lone["loader"] == [-1, -1] and lone["stored"] == []
    assert lone["after"] not in (saved[0]["after"], saved[1]["after"])
    assert any("rank 2 finds no state of its own" in n for n in lone["notes"])
    assert lone["warnings"] == lone["notes"]

    # one process (no process group): rank 0's own state, and the size change said
    torch.manual_seed(999)
    loader = w.Loader(-1, -1)
    with pytest.warns(RankStateWarning, match="2 processes and this run has 1"):
        result = ucpt.load_distributed(path, model=w.model(), rng=True,
                                       rank_state={"loader": loader})
    assert w.draws() == saved[0]["after"]
    assert [loader.position, loader.seed] == [3, 0]
    assert result.saved_world_size == 2 and result.rng is not None


def test_a_missing_entry_is_refused_before_anything_changes(tmp_path: Path) -> None:
    path = tmp_path / "one"
    net = w.model()
    ucpt.save_distributed(path, model=net, rng=True, rank_state={"loader": w.Loader(7, 1)})
    target = torch.nn.Linear(4, 3)
    before = target.weight.detach().clone()
    state = torch.get_rng_state()
    sampler, loader = w.Loader(-1, -1), w.Loader(-1, -1)
    with pytest.raises(KeyMismatchError, match=r"training/ranks/0.*holds no \['sampler'\]"):
        ucpt.load_distributed(path, model=target, rng=True,
                              rank_state={"loader": loader, "sampler": sampler})
    assert torch.equal(target.weight, before) and torch.equal(torch.get_rng_state(), state)
    assert [loader.position, sampler.position] == [-1, -1]
    # strict=False: what is there is loaded, the rest left as it is
    ucpt.load_distributed(path, model=target, rng=True, strict=False,
                          rank_state={"loader": loader, "sampler": sampler})
    assert [loader.position, sampler.position] == [7, -1]
    assert torch.equal(target.weight, net.weight)


def test_no_per_rank_state_is_said_not_silent(tmp_path: Path) -> None:
    path = tmp_path / "plain"
    ucpt.save_distributed(path, model=w.model())
    assert "training/ranks" not in ucpformat.open(path).groups
    loader = w.Loader(-1, -1)
    with pytest.warns(RankStateWarning, match="holds no per-rank state"):
        result = ucpt.load_distributed(path, model=w.model(), rank_state={"loader": loader})
    assert result.rank_state is None and result.saved_world_size is None
    assert loader.position == -1 and len(result.rank_notes) == 1
    # asking for nothing per rank says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", RankStateWarning)
        assert ucpt.load_distributed(path, model=w.model()).rank_notes == []


def test_rank_state_names_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ucpformat.UCPError, match="pass them as rng="):
        ucpt.save_distributed(tmp_path / "x", model=w.model(), rank_state={"rng": w.Loader()})
    assert not (tmp_path / "x").exists()


def test_extra_takes_groups_and_numpy_arrays_as_save_does(tmp_path: Path) -> None:
    """``extra`` of ``save_distributed`` stores a ``Group`` as a group and numpy arrays as
    arrays, as ``ucpformat.save`` does (the trainers hand every rank's generators, in the
    form of R085, through it)."""
    import numpy as np

    from ucpformat.checkpoint.tree import Group

    ucpt.save_distributed(tmp_path / "c", model=w.model(), extra={
        "python_like": Group({"kind": "python", "version": 3}),
        "key": np.arange(5, dtype=np.uint32),
        "nested": {"ids": np.arange(2, dtype=np.int64), "n": 1}})
    ckpt = ucpformat.open(tmp_path / "c")
    assert "training/python_like" in ckpt.groups
    assert ckpt.values("training/python_like") == {"kind": "python", "version": 3}
    assert ckpt["training/key"].read().dtype == np.uint32
    assert ckpt["training/nested/ids"].read().tolist() == [0, 1]
    assert ckpt.values("training/nested") == {"n": 1}


def test_single_process_extra_takes_groups_and_numpy_arrays(tmp_path: Path) -> None:
    """The same for ``ucpformat.torch.save``'s ``extra``."""
    import numpy as np

    from ucpformat.checkpoint.tree import Group

    ucpt.save(tmp_path / "c", model=w.model(), extra={
        "python_like": Group({"kind": "python", "version": 3}),
        "key": np.arange(5, dtype=np.uint32)})
    ckpt = ucpformat.open(tmp_path / "c")
    assert ckpt.values("training/python_like") == {"kind": "python", "version": 3}
    assert ckpt["training/key"].read().tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_saves_take_each_ranks_state_at_call_time(tmp_path: Path, writer: str) -> None:
    """``AsyncSaver.save(rng=..., rank_state=...)``, with either writer: the generators and
    the loader as they were when the call returned, not when the write ran."""
    net = w.model()
    torch.manual_seed(5)
    loader = w.Loader(position=9, seed=2)
    saver = ucpt.AsyncSaver(writer=writer)  # type: ignore[arg-type]
    try:
        future = saver.save(tmp_path / "c", model=net, rng=True, rank_state={"loader": loader})
        after = w.draws()
        loader.position = 100  # changed while the write may still run
        future.result()
    finally:
        saver.close()
    again = w.Loader(-1, -1)
    result = ucpt.load_distributed(tmp_path / "c", model=w.model(), rng=True,
                                   rank_state={"loader": again})
    assert w.draws() == after and [again.position, again.seed] == [9, 2]
    assert result.saved_world_size == 1 and result.rank_notes == []
