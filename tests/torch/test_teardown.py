"""Distributed recipes end the way that does not abort at exit (issue 29, item 1).

With torch 2.13 and gloo, destroying the process group right after the last collective
sometimes aborts the process at shutdown; a barrier first avoids it. The recipe of
docs/torch-distributed.md and the launcher of the demos end with the barrier, and no
gloo operation or tensor of ucpformat outlives ``save_distributed`` / ``load_distributed``
(measured: ``python -m ucpformat.testing.teardown``)."""

from __future__ import annotations

import gc
import inspect
import re
import weakref
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.torch import launch  # noqa: E402

pytestmark = pytest.mark.torch

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _ends_safely(code: str) -> bool:
    """``dist.barrier()`` before every ``dist.destroy_process_group()``, nothing between."""
    lines = [ln.strip() for ln in code.splitlines() if ln.strip() and not
             ln.strip().startswith("#")]
    ends = [i for i, ln in enumerate(lines) if ln.startswith("dist.destroy_process_group()")]
    return bool(ends) and all(i > 0 and lines[i - 1].startswith("dist.barrier()") for i in ends)


def test_the_docs_recipe_ends_with_a_barrier() -> None:
    text = (DOCS / "torch-distributed.md").read_text()
    section = text.split("## Ending a torchrun script", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert _ends_safely(code)
    compile(code, "torch-distributed.md", "exec")
    assert "TEARDOWN_RESULT" not in section  # the measured numbers are filled in
    # no other recipe in the docs tears a process group down without the barrier
    for doc in DOCS.glob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            if "destroy_process_group" in block:
                assert _ends_safely(block), doc.name


def test_the_demos_launcher_ends_with_a_barrier() -> None:
    assert _ends_safely(inspect.getsource(launch._entry))


COLLECTIVES = ("all_gather", "all_to_all_single", "barrier", "broadcast", "all_reduce",
               "gather", "scatter", "send", "recv", "isend", "irecv", "all_gather_object",
               "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor")


def test_no_gloo_work_outlives_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective of a save and a load is synchronous, and every tensor handed to
    gloo is gone when the call returns (one rank: the same code path as N)."""
    calls: list[tuple[str, Any]] = []
    handed: list[weakref.ref[Any]] = []

    def wrap(name: str) -> Any:
        real = getattr(dist, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, kwargs.get("async_op", False)))
            for a in [*args, *kwargs.values()]:
                for t in (a if isinstance(a, list | tuple) else [a]):
                    if isinstance(t, torch.Tensor):
                        handed.append(weakref.ref(t))
            return real(*args, **kwargs)

        return recorded

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, wrap(name))
        model = torch.nn.Linear(8, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        ucpt.save_distributed(tmp_path / "ckpt", model=model, optimizer=optimizer, step=1,
                              durable=False)
        ucpt.load_distributed(tmp_path / "ckpt", model=model, optimizer=optimizer)
        gc.collect()
        assert calls, "no collective went through torch.distributed"
        assert [c for c in calls if c[1]] == [], "an asynchronous collective"
        alive = [r() for r in handed if r() is not None]
        assert not alive, f"{len(alive)} tensor(s) handed to gloo outlive the call"
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
