"""DeepSpeed ZeRO-1/2/3 (fp32, bf16) <-> UCP, against real DeepSpeed 0.19.8 runs on CPU.

Imports must equal DeepSpeed's own consolidation: ``zero_to_fp32`` for the weights,
``ds_to_universal`` for the fp32 master weights and Adam moments. Exports to the
universal layout are loaded by DeepSpeed itself (``load_universal``) on 3 ranks (the
runs trained on 2), and what it loaded must equal the source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.importers.conftest import (
    _run_framework,
    assert_same,
    cached_framework_run,
    shared_cache,
)
from ucpformat import exporters, importers

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIGS = [f"zero{stage}-{dtype}" for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]
#: DeepSpeed AutoTP runs: a small Llama, tensor parallel over the 2 ranks
AUTOTP = ["autotp2-zero1-fp32", "autotp2-zero2-bf16"]
#: (source run, ZeRO stage of the loading engine): same stage, and across stages; the
#: tensor-parallel runs resume without tensor parallelism, data parallel over 3 ranks
LOADS = [(c, int(c[4])) for c in CONFIGS] + [("zero3-bf16", 1), ("zero1-fp32", 3)] + [
    (c, int(c[len("autotp2-zero")])) for c in AUTOTP]


def _stage_of(cfg: str) -> int:
    return int(cfg.split("zero")[1][0])


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_framework_run(tmp_path_factory, "deepspeed")


def _fp32_path(ckpt: ucpformat.Checkpoint, name: str) -> tuple[str, ...]:
    if ckpt.tensor("model", name).meta.dtype.name == "float32":
        return ("model", name)
    return ("optimizer", "state", name, "master")


@pytest.fixture(scope="session")
def imported(ds_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def build(base: Path) -> None:
        for cfg in CONFIGS + AUTOTP:
            importers.convert(ds_runs / cfg, base / cfg, durable=False)

    base = shared_cache(tmp_path_factory, "ds-imported", build)
    return {cfg: base / cfg for cfg in CONFIGS + AUTOTP}


@pytest.mark.parametrize("cfg", CONFIGS)
def test_import_equals_zero_to_fp32(ds_runs: Path, imported: dict[str, Path], cfg: str) -> None:
    ckpt = ucpformat.open(imported[cfg])
    assert ucpformat.validate(imported[cfg], deep=True).valid
    reference = torch.load(ds_runs / cfg / "zero_to_fp32.pt", weights_only=True)
    for name, want in reference.items():
        if name == "running":  # a buffer: as saved
            assert_same(ckpt.tensor("model", name).read(), want, name)
            continue
        assert_same(ckpt.tensor(*_fp32_path(ckpt, name)).read(), want, f"{cfg} {name}")
    dtype = "bfloat16" if cfg.endswith("bf16") else "float32"
    assert ckpt.tensor("model", "fc1.weight").meta.dtype.name == dtype
    assert ckpt.values("training")["step"] == 3
    groups = ckpt.values("optimizer")["param_groups"]
    assert groups[0]["params"] == ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight",
                                   "fc2.bias"]
    assert groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("cfg", CONFIGS + AUTOTP)
def test_import_equals_ds_to_universal(ds_runs: Path, imported: dict[str, Path], cfg: str) -> None:
    ckpt = ucpformat.open(imported[cfg])
    universal = ds_runs / cfg / "universal" / "zero"
    checked = 0
    for pdir in sorted(p for p in universal.iterdir() if p.is_dir()):
        name = pdir.name
        if name == "running":
            continue
        for f in pdir.glob("*.pt"):
            value = torch.load(f, weights_only=False)
            value = value["param"] if isinstance(value, dict) else value
            state = f.stem
            if state == "fp32":
                got = ckpt.tensor(*_fp32_path(ckpt, name)).read()
            else:
                got = ckpt.tensor("optimizer", "state", name, state).read()
            want = value.reshape(got.shape)  # ZeRO-3's universal files are flat
            assert_same(got, want, f"{cfg} {name}/{state}")
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("cfg", ["zero1-bf16", "zero2-bf16", "zero3-bf16"])
def test_bf16_weights_are_the_rounded_master(imported: dict[str, Path], cfg: str) -> None:
    """The training-precision weights are what DeepSpeed copies from the master."""
    ckpt = ucpformat.open(imported[cfg])
    for name in ("emb.weight", "fc2.bias"):
        master = torch.from_numpy(ckpt.tensor("optimizer", "state", name, "master").read())
        assert_same(ckpt.tensor("model", name).read(), master.to(torch.bfloat16), name)


@pytest.fixture(scope="session")
def loaded_by_deepspeed(imported: dict[str, Path],
                        tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Any]:
    def result(base: Path, cfg: str, stage: int) -> Path:
        return base / f"{cfg}-as-zero{stage}.loaded.pt"

    def build(base: Path) -> None:
        jobs = []
        for cfg, stage in LOADS:
            dest = base / f"{cfg}-as-zero{stage}"
            exporters.export(imported[cfg], dest, to="deepspeed-universal")
            jobs.append({"stage": _stage_of(cfg), "load_stage": stage,
                         "dtype": cfg.split("-")[-1], "dir": str(dest), "tag": None,
                         "model": "llama" if cfg in AUTOTP else "dsnet",
                         "result": str(result(base, cfg, stage))})
        (base / "jobs.json").write_text(json.dumps(jobs))
        _run_framework("ds-universal-load", base, "--world", "3")

    base = shared_cache(tmp_path_factory, "ds-universal-load", build)
    return {(cfg, stage): torch.load(result(base, cfg, stage), weights_only=True)
            for cfg, stage in LOADS}


def test_tensor_parallel_semantics_from_universal_checkpoint_info(
    imported: dict[str, Path]
) -> None:
    ckpt = ucpformat.open(imported["autotp2-zero1-fp32"])
    layout = {t.name: dict(t.attributes).get("layout") for t in ckpt.tensors("model")}
    assert layout["model.layers.0.self_attn.o_proj.weight"] == {"tp": {"dim": 1}}
    assert layout["model.layers.1.mlp.up_proj.weight"] == {"tp": {"dim": 0}}
    assert layout["lm_head.weight"] == {"tp": {"dim": 0}, "vocab": {"dim": 0}}
    assert layout["model.norm.weight"] is None
    assert ckpt.tensor("model", "model.layers.0.mlp.down_proj.weight").shape == (32, 64)
    assert ckpt.metadata["source"]["tp_world_size"] == 2


@pytest.mark.parametrize(("cfg", "stage"), LOADS)
def test_deepspeed_resumes_from_the_export_on_3_ranks(
    imported: dict[str, Path], loaded_by_deepspeed: dict[tuple[str, int], Any], cfg: str,
    stage: int,
) -> None:
    got = loaded_by_deepspeed[(cfg, stage)]
    ckpt = ucpformat.open(imported[cfg])
    assert int(got.pop("global_steps")) == 3
    assert np.all(got.pop("adam_step").numpy() == 3)
    for key, value in got.items():
        kind, name = key.split("/", 1)
        if kind == "fp32":
            want = ckpt.tensor(*_fp32_path(ckpt, name)).read()
        elif kind == "module":
            want = ckpt.tensor("model", name).read()
        else:
            want = ckpt.tensor("optimizer", "state", name, kind).read()
        assert_same(value, want, f"{cfg} as ZeRO-{stage}: {key}")


def test_cli_convert_and_export(ds_runs: Path, tmp_path: Path) -> None:
    from ucpformat.importers.cli import main

    assert main(["convert", str(ds_runs / "zero2-fp32"), str(tmp_path / "ckpt"),
                 "--no-progress"]) == 0
    assert main(["export", "--to", "deepspeed-universal", str(tmp_path / "ckpt"),
                 str(tmp_path / "uni"), "--tag", "resume", "--json"]) == 0
    assert (tmp_path / "uni" / "latest_universal").read_text() == "resume"
    assert (tmp_path / "uni" / "resume" / "zero" / "fc1.weight" / "exp_avg.pt").is_file()
    assert main(["convert", str(ds_runs / "zero2-fp32"), str(tmp_path / "x"),
                 "--allow-pickle"]) == 2  # DeepSpeed files need no pickle consent
