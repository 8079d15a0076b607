"""ucpformat.deepspeed against real DeepSpeed 0.19.8 engines (gloo, CPU; see harness.py).

* Saves on 4 ranks under ZeRO-1/2/3 x fp32/bf16 and ZeRO-2 fp16 equal ``ucp convert`` of
  DeepSpeed's own ``save_checkpoint`` of the same run, array for array, bit for bit.
* Resumes on 2, 3 and 1 ranks, with another ZeRO stage and another precision, equal
  DeepSpeed's own path (``save_checkpoint`` -> ``ds_to_universal`` -> ``load_universal``):
  the flat partitions (padding included), every optimizer state, the 16-bit weights,
  hyperparameters, LR scheduler, counters, gradient clipping and loss scaler; both then
  train on to the same losses; a resumed engine saved again gives the same arrays.
* Frozen parameters, tied ones, client state, the checkpoint-engine plug-in, the
  asynchronous save, checkpoints of other writers, refusals, a failing and a dying rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.deepspeed.conftest import array_differences
from ucpformat.errors import IncompleteCheckpointError

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from tests.deepspeed.harness import (  # noqa: E402  (needs torch)
    LOADS,
    READ_VOLUME,
    SOURCES,
    load_name,
)

#: the one array only ours has: save_checkpoint was given the client state without its tensor
CONVERT_ONLY = ("training/rng",)


def _ok(results: dict[str, Any], name: str) -> None:
    assert name in results["checks"], f"the harness did not run {name!r}"
    problems = results["checks"][name]
    assert not problems, f"{name}:\n" + "\n".join(problems[:8])


@pytest.fixture(scope="session")
def converted(ds_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``ucp convert`` of DeepSpeed's save_checkpoint of every matrix run."""
    from tests.importers.conftest import shared_cache
    from ucpformat import importers

    def build(base: Path) -> None:
        for src in SOURCES:
            importers.convert(ds_run / "ds" / src, base / src, durable=False)

    base = shared_cache(tmp_path_factory, "deepspeed-converted", build)
    return {src: base / src for src in SOURCES}


@pytest.mark.parametrize("src", SOURCES)
def test_save_equals_ucp_convert_of_save_checkpoint(
    ds_run: Path, results: dict[str, Any], converted: dict[str, Path], src: str
) -> None:
    _ok(results, f"save {src}")
    ours = ds_run / "ucp" / src
    assert ucpformat.validate(ours, deep=True).valid
    assert array_differences(ours, converted[src], skip=CONVERT_ONLY) == []
    with ucpformat.open(ours) as ckpt:
        training = ckpt.values("training")
        assert training["step"] == 3 and training["epoch"] == 7 and training["note"] == src
        assert training["scheduler"] == {"last_batch_iteration": 2}
        assert ckpt.tensor("training", "rng").read().tolist() == [0, 1, 2, 3, 4]
        optimizer = ckpt.values("optimizer")
        assert optimizer["param_groups"][0]["params"] == [
            "emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert optimizer["deepspeed"]["zero_stage"] == int(src[4])
        mixed = not src.endswith("fp32")
        assert ("master_weights" in optimizer) == mixed
        assert ckpt.metadata["source"]["dp_world_size"] == 4
        if src.endswith("fp16"):  # the dynamic loss scaler's state
            scaler = optimizer["deepspeed"]["loss_scaler"]
            assert scaler["dynamic"] is True and scaler["cur_iter"] == 3
    # written straight into the format: no per-rank files, no pickle
    assert not list(ours.rglob("*.pt"))


@pytest.mark.parametrize(("src", "world", "stage", "dtype"), LOADS,
                         ids=[load_name(*load) for load in LOADS])
def test_resume_equals_deepspeeds_own_path(
    ds_run: Path, results: dict[str, Any], src: str, world: int, stage: int, dtype: str
) -> None:
    """Bit for bit what load_universal gives, then the same training; saved again, the
    same arrays (in the resumed precision: masters, states and counters unchanged)."""
    name = load_name(src, world, stage, dtype)
    _ok(results, name)
    original, resaved = ds_run / "ucp" / src, ds_run / "resaved" / name
    if dtype == src.split("-")[1]:
        assert array_differences(original, resaved) == []
        return
    with ucpformat.open(original) as a, ucpformat.open(resaved) as b:
        for param in ("emb.weight", "fc1.weight", "fc2.bias"):
            def master(ckpt: ucpformat.Checkpoint, name: str = param) -> Any:
                path = ("optimizer", "state", name, "master")
                return ckpt.tensor(*path).read() if ckpt.tensor("model", name).meta.dtype.name \
                    != "float32" else ckpt.tensor("model", name).read()

            assert np.array_equal(master(a), master(b))
            for state in ("exp_avg", "exp_avg_sq", "step"):
                assert np.array_equal(a.tensor("optimizer", "state", param, state).read(),
                                      b.tensor("optimizer", "state", param, state).read())
        assert b.tensor("model", "fc1.weight").meta.dtype.name == (
            "bfloat16" if dtype == "bf16" else "float32")


def test_deepspeeds_own_chain_needs_repairs_across_stages(results: dict[str, Any]) -> None:
    """What the harness had to add so that DeepSpeed's loaders read ds_to_universal's
    output at another ZeRO stage (docs/deepspeed.md): packaging only, never values."""
    repairs = results["repairs"]
    assert any("optimizer_state_dict" in r for r in repairs["zero1-fp32"])
    assert any("wrapped" in r for r in repairs["zero3-bf16"])
    assert any("step.pt" in r for r in repairs["zero3-bf16"])
    assert not any("wrapped" in r for r in repairs["zero2-bf16"])


def test_frozen_and_tied_parameters(ds_run: Path, results: dict[str, Any]) -> None:
    for src, name in (("frozen-zero3-bf16", load_name("frozen-zero3-bf16", 2, 2, "bf16")),
                      ("frozen-zero1-fp32", load_name("frozen-zero1-fp32", 3, 3, "fp32"))):
        _ok(results, f"save {src}")
        _ok(results, name)
        assert array_differences(ds_run / "ucp" / src, ds_run / "resaved" / name) == []
        with ucpformat.open(ds_run / "ucp" / src) as ckpt:
            assert ckpt.groups["model"].ucp["aliases"] == {"head.weight": "emb.weight"}
            frozen = ckpt.tensor("model", "proj.weight")
            assert frozen.attributes["role"] == "parameter"
            assert ("optimizer/state/proj.weight/exp_avg" not in ckpt
                    and "proj.weight" not in ckpt.values("optimizer")["param_groups"][0]["params"])
            assert ckpt.tensor("model", "running").attributes["role"] == "buffer"


def test_the_checkpoint_engine_plug_in(ds_run: Path, results: dict[str, Any]) -> None:
    """engine.save_checkpoint with UCPCheckpointEngine writes what save() writes."""
    _ok(results, "checkpoint engine plug-in")
    tag = (ds_run / "plugin" / "latest").read_text().strip()
    assert tag == "global_step3"
    ckpt_dir = ds_run / "plugin" / tag
    assert array_differences(ckpt_dir, ds_run / "plugin-direct") == []
    assert sorted(p.name for p in (ds_run / "plugin").iterdir() if p.suffix == ".pt") == []
    with ucpformat.open(ckpt_dir) as ckpt:
        assert ckpt.values("training")["epoch"] == 7  # the client state DeepSpeed passed on


def test_asynchronous_save(ds_run: Path, results: dict[str, Any]) -> None:
    """The snapshot taken at the call, written while training went on."""
    _ok(results, "asynchronous save")
    assert (ds_run / "async" / "latest").read_text() == "step3"
    assert array_differences(ds_run / "async" / "step3", ds_run / "async-sync") == []


def test_checkpoints_of_other_writers_load(results: dict[str, Any]) -> None:
    _ok(results, "other paths")
    _ok(results, "load ucp convert's checkpoint")
    _ok(results, "load the torch API's checkpoint")
    _ok(results, "weights only, from a checkpoint without optimizer state")


@pytest.mark.parametrize(("check", "where"), [
    ("load the DCP plugin's checkpoint", "dcp-path"),
    ("load save_distributed's checkpoint", "distributed-path"),
])
def test_checkpoints_of_distributed_writers_load(ds_run: Path, results: dict[str, Any],
                                                 check: str, where: str) -> None:
    """Written on 2 ranks by dcp.save through the plugin (model and optimizer state
    dicts) or by ucpformat.torch.save_distributed: a DeepSpeed engine (ZeRO-3 bf16,
    ZeRO-1 fp32) loads the fp32 masters and Adam moments torch trained, bit for bit."""
    _ok(results, check)
    with ucpformat.open(ds_run / where) as ckpt:
        assert ckpt["optimizer/state/fc1.weight/exp_avg"].shape == (29, 12)
        assert "optimizer/state/fc1.weight/master" not in set(ckpt.keys())


@pytest.mark.parametrize("check", ["refuse another shape", "refuse another name",
                                   "refuse a damaged checkpoint",
                                   "refuse a value of another kind",
                                   "refuse a counter of another kind"])
def test_bad_input_is_refused_before_anything_changes(results: dict[str, Any],
                                                      check: str) -> None:
    """Every rank raises (naming the tensor, or the rank that could not read it) and every
    rank's engine is as it was: flat partitions, states, weights, counters."""
    _ok(results, check)


def test_a_failing_rank_commits_nothing(results: dict[str, Any]) -> None:
    _ok(results, "a failed save commits nothing")


def test_a_rank_that_dies_while_saving_commits_nothing(ds_run: Path,
                                                       results: dict[str, Any]) -> None:
    """The tag being written is not a checkpoint; ``latest`` still names the previous
    tag, which is intact: a resume picks it."""
    from ucpformat.deepspeed import resolve_location

    assert "exit code 17" in results["crash"], results["crash"]
    where = ds_run / "crashed" / "step4"
    assert where.is_dir() and not (where / "zarr.json").exists()
    with pytest.raises(IncompleteCheckpointError):
        ucpformat.open(where)
    assert (ds_run / "crashed" / "latest").read_text() == "step3"
    previous = resolve_location(ds_run / "crashed")
    assert previous == str(ds_run / "crashed" / "step3")
    assert ucpformat.validate(previous, deep=True).valid
    with ucpformat.open(previous) as ckpt:
        assert ckpt.values("training")["step"] == 3


def test_a_load_reads_about_its_share(ds_run: Path, results: dict[str, Any]) -> None:
    """Tensors of 37 x 256 and 256 x 256 saved under ZeRO-2 on 4 ranks (partitions end
    inside rows), loaded on 2 and 3 ranks: the same arrays when saved again, and on 2
    ranks each rank reads well under the checkpoint's data (DeepSpeed's universal loader
    reads every whole tensor on every rank)."""
    src, loads = READ_VOLUME
    with ucpformat.open(ds_run / "ucp" / src) as ckpt:
        data = sum(int(np.prod(ckpt[k].shape)) * ckpt[k].read().dtype.itemsize
                   for k in ckpt.arrays)
    for world, stage in loads.items():
        name = load_name(src, world, stage, "fp32")
        _ok(results, name)
        assert array_differences(ds_run / "ucp" / src, ds_run / "resaved" / name) == []
    reads = [results["bytes_read"][f"{load_name(src, 2, loads[2], 'fp32')} rank{r}"]
             for r in range(2)]
    assert all(0 < n < 0.7 * data for n in reads), (reads, data)
