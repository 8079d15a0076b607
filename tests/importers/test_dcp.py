"""PyTorch DCP -> UCP, against checkpoints FSDP2, TP and FSDP2 x TP runs wrote (gloo, CPU).

Every tensor must equal what torch's own ``dcp_to_torch_save`` consolidates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ucpformat
from tests.importers.conftest import assert_same, cached_framework_run
from ucpformat import importers
from ucpformat.errors import FormatError

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RUNS = ["fsdp2", "tp", "2d"]


@pytest.fixture(scope="session")
def dcp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_framework_run(tmp_path_factory, "dcp")


def _reference(src: Path, tmp: Path) -> Any:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, tmp / "reference.pt")
    return torch.load(tmp / "reference.pt", weights_only=False)


def test_metadata_pickle_needs_consent(dcp_runs: Path, tmp_path: Path) -> None:
    src = dcp_runs / "fsdp2"
    assert importers.detect(src) == "dcp"
    with pytest.raises(FormatError, match="allow_pickle=True"):
        importers.convert(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("run", RUNS)
def test_equals_dcp_to_torch_save(dcp_runs: Path, tmp_path: Path, run: str) -> None:
    src = dcp_runs / run
    result = importers.convert(src, tmp_path / "ckpt", allow_pickle=True, durable=False)
    ref = _reference(src, tmp_path)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid
    n = 0
    for name, want in ref["model"].items():
        assert_same(ckpt.tensor("model", name).read(), want, f"{run} model {name}")
        n += 1
    assert ckpt.tensor("model", "scale").meta.dtype.name == "bfloat16"
    for pname, states in ref["optim"]["state"].items():
        for sname, want in states.items():
            assert_same(ckpt.tensor("optimizer", "state", pname, sname).read(), want,
                        f"{run} {pname}.{sname}")
            n += 1
    assert result.tensors == n
    groups = ckpt.values("optimizer")["param_groups"]
    assert groups[0]["params"] == ref["optim"]["param_groups"][0]["params"]
    assert groups[0]["lr"] == ref["optim"]["param_groups"][0]["lr"]
    assert ckpt.values("training") == {"step": 2}
    assert ckpt.values("training/extra") == {"note": run}


def test_bare_model_state_dict(dcp_runs: Path, tmp_path: Path) -> None:
    src = dcp_runs / "fsdp2-model"
    importers.convert(src, tmp_path / "ckpt", allow_pickle=True, durable=False)
    ref = _reference(src, tmp_path)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert sorted(t.name for t in ckpt.tensors("model")) == sorted(ref)
    for name, want in ref.items():
        assert_same(ckpt.tensor("model", name).read(), want, name)


def test_same_values_whatever_the_parallel_layout(dcp_runs: Path, tmp_path: Path) -> None:
    """The three runs trained the same model differently: fp32 sums differ only in order,
    but the consolidated tensors have one shape and dtype, and the untouched buffer is equal."""
    ckpts = []
    for run in RUNS:
        importers.convert(dcp_runs / run, tmp_path / run, allow_pickle=True, durable=False)
        ckpts.append(ucpformat.open(tmp_path / run))
    for path in ckpts[0]:
        metas = [c[path].meta for c in ckpts]
        assert len({(m.shape, m.dtype.name) for m in metas}) == 1, path
    assert_same(ckpts[1].tensor("model", "scale").read(), ckpts[0].tensor("model", "scale").read())


def test_hostile_metadata_is_refused_even_with_consent(dcp_runs: Path, tmp_path: Path) -> None:
    import os
    import pickle
    import shutil

    src = tmp_path / "evil"
    shutil.copytree(dcp_runs / "tp", src)

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("touch /tmp/ucp-dcp-evil",))

    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(FormatError, match="not a DCP metadata class"):
        importers.convert(src, tmp_path / "ckpt", allow_pickle=True)
    assert not Path("/tmp/ucp-dcp-evil").exists()


def test_layout_semantics_from_a_rule_file(dcp_runs: Path, tmp_path: Path) -> None:
    rules = tmp_path / "net.json"
    rules.write_text("""{
      "name": "dcp-net", "rules": [
        {"pattern": "emb.weight", "layout": {"tp": {"dim": 0}, "vocab": {"dim": 0}}},
        {"pattern": "fc1.*", "layout": {"tp": {"dim": 0}}},
        {"pattern": "fc2.weight", "layout": {"tp": {"dim": 1}}},
        {"pattern": "**"}
      ]}""")
    importers.convert(dcp_runs / "tp", tmp_path / "ckpt", allow_pickle=True, rules=rules,
                      durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ckpt.tensor("model", "fc2.weight").attributes["layout"] == {"tp": {"dim": 1}}
    assert ckpt.tensor("model", "fc1.bias").attributes["layout"] == {"tp": {"dim": 0}}
    assert "layout" not in ckpt.tensor("model", "fc2.bias").attributes
    assert ucpformat.validate(tmp_path / "ckpt").valid
