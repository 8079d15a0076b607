"""The ``ucp`` command: exit statuses, output shapes, and what each command reads."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ucpformat
from tests.helpers import one_error_line, ucp
from ucpformat.checkpoint.metadata import MANIFEST_KEY, ZARR_JSON
from ucpformat.cli.diff import blocks, compare_tensors

REPO = Path(__file__).resolve().parents[1]


def data_files(path: Path) -> list[Path]:
    """Every stored chunk or shard object (everything but metadata and the manifest)."""
    return [
        p for p in path.rglob("*")
        if p.is_file() and p.name != ZARR_JSON and p.name != MANIFEST_KEY
    ]


# -- the command itself ---------------------------------------------------------------


def test_help_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ucpformat.cli", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    for command in ("inspect", "validate", "diff", "tour", "demo"):
        assert command in proc.stdout


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = ucp(capsys, "no-such-command")
    assert code == 2
    assert one_error_line(err).startswith("ucp: error:")
    code, _, err = ucp(capsys, "validate", "x", "--json", "--quiet")
    assert code == 2
    code, _, err = ucp(capsys, "diff", "a", "b", "--atol", "-1")
    assert code == 2
    assert "must be a finite number" in err
    code, _, _ = ucp(capsys)
    assert code == 2


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert ucp(capsys, "--help")[0] == 0
    code, out, _ = ucp(capsys, "--version")
    assert code == 0 and ucpformat.__version__ in out


# -- validate ---------------------------------------------------------------------------


def test_validate_valid(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]) -> None:
    path = saved()
    code, out, err = ucp(capsys, "validate", str(path))
    assert code == 0, out + err
    assert out.strip().splitlines()[-1].startswith("valid:")
    code, out, _ = ucp(capsys, "validate", "--deep", "--json", str(path))
    assert code == 0
    assert json.loads(out) == {"valid": True, "errors": [], "warnings": []}
    code, out, _ = ucp(capsys, "validate", "--quiet", str(path))
    assert code == 0 and out == ""


def test_validate_invalid(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]) -> None:
    path = saved()
    victim = next(p for p in data_files(path) if "fc.weight" in str(p))
    victim.unlink()
    code, out, _ = ucp(capsys, "validate", "--json", str(path))
    assert code == 1
    doc = json.loads(out)
    assert set(doc) == {"valid", "errors", "warnings"}
    assert doc["valid"] is False
    assert all(set(e) == {"rule", "path", "message"} for e in doc["errors"] + doc["warnings"])
    assert "UCP-1.0-R031" in {e["rule"] for e in doc["errors"]}
    # text: one line per issue, then the verdict
    code, out, _ = ucp(capsys, "validate", str(path))
    lines = out.strip().splitlines()
    assert code == 1
    assert lines[0].startswith("error: [UCP-1.0-R031] ")
    assert lines[-1].startswith("invalid:")
    assert len(lines) == len(doc["errors"]) + len(doc["warnings"]) + 1
    code, out, _ = ucp(capsys, "validate", "--quiet", str(path))
    assert code == 1 and out == ""


@pytest.mark.parametrize("hash_algorithm", [None, "sha256"])
def test_validate_deep_finds_a_flipped_bit(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path], hash_algorithm: str | None
) -> None:
    path = saved(hash_algorithm=hash_algorithm)
    victim = next(p for p in data_files(path) if "fc.weight" in str(p))
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0x40
    victim.write_bytes(bytes(raw))
    assert ucp(capsys, "validate", str(path))[0] == 0  # metadata alone cannot see it
    code, out, _ = ucp(capsys, "validate", "--deep", "--json", str(path))
    assert code == 1
    rules = {e["rule"] for e in json.loads(out)["errors"]}
    assert "UCP-1.0-R041" in rules  # the chunk's CRC32C
    assert ("UCP-1.0-R043" in rules) == (hash_algorithm == "sha256")  # the manifest's SHA-256


def test_validate_uncommitted_is_invalid(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]
) -> None:
    path = saved()
    (path / ZARR_JSON).unlink()
    code, out, _ = ucp(capsys, "validate", "--json", str(path))
    assert code == 1
    assert json.loads(out)["errors"][0]["rule"] == "UCP-1.0-R051"


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_missing_or_unusable_path_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    code, out, err = ucp(capsys, command, str(tmp_path / "nope"))
    assert code == 2 and out == ""
    expected = f"ucp: error: [UCP-1.0-R051] {tmp_path / 'nope'}: no such file or directory"
    assert one_error_line(err) == expected
    a_file = tmp_path / "file"
    a_file.write_text("x")
    code, _, err = ucp(capsys, command, str(a_file))
    assert code == 2
    assert "a checkpoint is a directory, or one file" in one_error_line(err)
    code, out, _ = ucp(capsys, command, "--json", str(tmp_path / "nope"))
    assert code == 2 and out == ""  # no half document on stdout
    (tmp_path / "empty").mkdir()
    code, _, err = ucp(capsys, command, str(tmp_path / "empty"))
    assert code == 2
    assert "UCP-1.0-R051" in one_error_line(err)


def test_progress_bars_stay_off_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    from ucpformat.progress import byte_progress

    with byte_progress(True, 100, "testing") as advance:
        advance(100)
    assert capsys.readouterr().out == ""


# -- inspect ----------------------------------------------------------------------------


def test_inspect_tree(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path],
                      small_state: dict[str, Any]) -> None:
    small_state["model"]["語彙/embed"] = np.arange(6, dtype=np.int64).reshape(2, 3)
    path = saved(small_state, metadata={"run": "unit-test"}, compression="zstd")
    code, out, _ = ucp(capsys, "inspect", str(path))
    assert code == 0
    assert "UCP 1.0" in out and "unit-test" in out
    assert "語彙/embed  int64 [2, 3]" in out  # logical name, not its escaped node name
    assert "%2F" not in out
    assert "fc.weight  float32 [96, 40]" in out and "zstd:3" in out
    assert "emb.weight  bfloat16 [33, 8]" in out
    assert "type = torch.optim.AdamW" in out
    assert "param_groups = 1 group; [0] 2 params lr=0.001" in out
    assert "training/  0 tensors" in out
    assert "step = 3" in out and "best_loss = inf" in out
    manifest = json.loads((path / MANIFEST_KEY).read_text())
    assert out.strip().splitlines()[-1].endswith(f"{len(manifest['files'])} files")
    assert "8 tensors" in out.strip().splitlines()[-1]


def test_inspect_json(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]) -> None:
    path = saved()
    code, out, _ = ucp(capsys, "inspect", "--json", str(path))
    assert code == 0
    doc = json.loads(out)
    assert {"location", "version", "metadata", "groups", "tensors", "files"} <= set(doc)
    assert doc["version"] == "1.0"
    assert doc["groups"]["optimizer"]["type"] == "torch.optim.AdamW"
    assert doc["groups"]["training"] == {"step": 3, "best_loss": {"$ucp_float": "Infinity"}}
    assert doc["step"] == 3
    manifest = json.loads((path / MANIFEST_KEY).read_text())
    assert doc["files"] == len(manifest["files"])
    by_path = {t["path"]: t for t in doc["tensors"]}
    assert len(by_path) == 7
    w = by_path["model/fc.weight"]
    assert set(w) >= {"path", "name", "shape", "dtype", "nbytes", "chunk_shape", "shard_shape",
                      "compression", "attributes"}
    assert (w["name"], w["shape"], w["dtype"], w["nbytes"]) == ("fc.weight", [96, 40], "float32",
                                                                96 * 40 * 4)
    assert by_path["model/emb.weight"]["dtype"] == "bfloat16"
    assert by_path["optimizer/state/fc.weight/step"]["shape"] == []


def test_inspect_reads_no_tensor_data(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]
) -> None:
    path = saved()
    before = ucp(capsys, "inspect", "--json", str(path))
    before_text = ucp(capsys, "inspect", str(path))
    removed = data_files(path)
    assert len(removed) >= 7
    for p in removed:
        p.unlink()
    assert ucp(capsys, "inspect", "--json", str(path)) == before
    assert ucp(capsys, "inspect", str(path)) == before_text


def test_inspect_attributes_and_layout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    layout = {"tp": {"dim": 0}, "parts": [{"name": "q", "size": 8}, {"name": "k", "size": 4},
                                         {"name": "v", "size": 4}], "groups": 2, "layer": 11}

    def attrs(path: str, arr: Any) -> dict[str, Any]:
        return {"ucp": {"role": "parameter", "layout": layout}}

    ucpformat.save(tmp_path / "c", {"model": {"qkv": np.ones((16, 4), np.float32)}},
                   array_attributes=attrs)
    code, out, _ = ucp(capsys, "inspect", str(tmp_path / "c"))
    assert code == 0
    assert "role=parameter layout[tp=dim0 parts=q:8,k:4,v:4 groups=2 layer=11]" in out
    doc = json.loads(ucp(capsys, "inspect", "--json", str(tmp_path / "c"))[1])
    assert doc["tensors"][0]["attributes"] == {"role": "parameter", "layout": layout}


def test_layout_text() -> None:
    from ucpformat.cli.inspect import layout_text

    assert layout_text({"experts": {"dim": 0, "count": 8}, "expert": 3}) == (
        "layout[experts=dim0,count=8 expert=3]"
    )
    assert layout_text({"vocab": {"dim": 0}, "x": {"y": 1}}) == 'layout[vocab=dim0 x={"y": 1}]'
    assert layout_text([1]) == "layout=[1]"


def test_inspect_truncates_large_groups(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    state = {"model": {f"layers.{i}.weight": np.zeros(2, np.float32) for i in range(30)}}
    ucpformat.save(tmp_path / "c", state)
    out = ucp(capsys, "inspect", str(tmp_path / "c"))[1]
    assert "… 18 more" in out
    out = ucp(capsys, "inspect", "--all", str(tmp_path / "c"))[1]
    assert "more" not in out
    assert all(f"layers.{i}.weight" in out for i in range(30))


def test_inspect_uncommitted_exits_1(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]
) -> None:
    path = saved()
    (path / ZARR_JSON).unlink()
    code, _, err = ucp(capsys, "inspect", str(path))
    assert code == 1
    assert one_error_line(err).startswith("ucp: error: [UCP-1.0-R051] ")


def test_debug_shows_a_traceback(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]
) -> None:
    path = saved()
    (path / ZARR_JSON).write_text("{not json")
    code, _, err = ucp(capsys, "inspect", str(path))
    assert code == 1
    assert one_error_line(err).startswith("ucp: error: [UCP-1.0-R001] ")
    code, _, err = ucp(capsys, "--debug", "inspect", str(path))
    assert code == 1
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("ucp: error: [UCP-1.0-R001] ")


# -- diff -------------------------------------------------------------------------------------


def test_diff_identical(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]) -> None:
    a, b = saved(name="a"), saved(name="b")
    code, out, _ = ucp(capsys, "diff", str(a), str(b))
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("identical: 7 equal")
    code, out, _ = ucp(capsys, "diff", "--json", str(a), str(b))
    doc = json.loads(out)
    assert code == 0 and doc["identical"] is True and doc["values"] == []
    assert {t["status"] for t in doc["tensors"]} == {"equal"}


def test_diff_different(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path],
                        small_state: dict[str, Any]) -> None:
    a = saved(name="a")
    w = small_state["model"]["fc.weight"]
    old = [float(w[3, 4]), float(w[5, 6])]
    w[3, 4] += 0.5
    w[5, 6] = w[5, 6] * 1.25
    new = [float(w[3, 4]), float(w[5, 6])]
    small_state["model"]["extra"] = np.zeros(3, np.float32)
    del small_state["model"]["fc.bias"]
    small_state["optimizer"]["state"]["fc.weight"]["exp_avg"] = np.ones((40, 96), np.float32)
    small_state["model"]["emb.weight"] = small_state["model"]["emb.weight"].astype(np.float32)
    small_state["optimizer"]["param_groups"][0]["lr"] = 2e-3
    del small_state["optimizer"]["param_groups"][0]["params"][1]
    del small_state["optimizer"]["state"]["fc.bias"]
    b = saved(small_state, name="b")
    code, out, _ = ucp(capsys, "diff", "--json", str(a), str(b))
    assert code == 1
    doc = json.loads(out)
    status = {t["path"]: t for t in doc["tensors"]}
    fc = status["model/fc.weight"]
    assert fc["status"] == "different" and fc["n_different"] == 2
    diffs = [abs(x - y) for x, y in zip(old, new, strict=True)]
    rels = [d / max(abs(x), abs(y)) for d, x, y in zip(diffs, old, new, strict=True)]
    assert fc["max_abs"] == max(diffs)
    assert fc["max_rel"] == max(rels)
    assert status["model/fc.bias"]["status"] == "only_in_a"
    assert status["model/extra"]["status"] == "only_in_b"
    assert status["optimizer/state/fc.weight/exp_avg"]["status"] == "shape_mismatch"
    assert status["model/emb.weight"]["status"] == "dtype_mismatch"
    assert status["model/emb.weight"]["dtype_a"] == "bfloat16"
    keys = {(v["group"], v["key"]): v for v in doc["values"]}
    assert keys[("optimizer", "param_groups[0].lr")]["a"] == 1e-3
    assert keys[("optimizer", "param_groups[0].lr")]["b"] == 2e-3
    assert keys[("optimizer", "param_groups[0].params")]["status"] == "different"
    # the text form: one line per difference and a verdict
    code, out, _ = ucp(capsys, "diff", str(a), str(b))
    assert code == 1
    assert "only in A  model/fc.bias" in out
    assert "only in B  model/extra" in out
    assert "different  model/fc.weight  max abs" in out
    assert "shape      optimizer/state/fc.weight/exp_avg  [96, 40] vs [40, 96]" in out
    assert "optimizer: param_groups[0].lr  0.001 -> 0.002" in out
    assert out.strip().splitlines()[-1].startswith("different:")


def test_diff_tolerance(capsys: pytest.CaptureFixture[str], saved: Callable[..., Path],
                        small_state: dict[str, Any]) -> None:
    a = saved(name="a")
    small_state["model"]["fc.weight"][0, 0] += 1e-4
    b = saved(small_state, name="b")
    assert ucp(capsys, "diff", str(a), str(b))[0] == 1
    code, out, _ = ucp(capsys, "diff", "--atol", "1e-3", "--json", str(a), str(b))
    assert code == 0
    statuses = {t["path"]: t["status"] for t in json.loads(out)["tensors"]}
    assert statuses["model/fc.weight"] == "close"
    assert ucp(capsys, "diff", "--rtol", "1e-9", str(a), str(b))[0] == 1


def test_diff_compares_bits(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    nan = np.array([np.nan, 0.0, 1.0], np.float32)
    ucpformat.save(tmp_path / "a", {"model": {"x": nan, "z": np.array([0.0], np.float32)}})
    ucpformat.save(tmp_path / "b", {"model": {"x": nan.copy(), "z": np.array([-0.0], np.float32)}})
    code, out, _ = ucp(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    status = {t["path"]: t for t in json.loads(out)["tensors"]}
    assert status["model/x"]["status"] == "equal"  # same NaN bits
    assert status["model/z"]["status"] == "different"  # 0.0 and -0.0 differ in bits
    assert status["model/z"]["max_abs"] == 0.0
    assert code == 1
    # numerically equal: within any tolerance
    assert ucp(capsys, "diff", "--atol", "0", str(tmp_path / "a"), str(tmp_path / "b"))[0] == 0


def test_diff_missing_checkpoint_exits_2(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path], tmp_path: Path
) -> None:
    a = saved()
    code, _, err = ucp(capsys, "diff", str(a), str(tmp_path / "nope"))
    assert code == 2
    assert "UCP-1.0-R051" in one_error_line(err)


def test_diff_damaged_checkpoint_exits_2(
    capsys: pytest.CaptureFixture[str], saved: Callable[..., Path]
) -> None:
    a, b = saved(name="a"), saved(name="b")
    next(p for p in data_files(b) if "fc.weight" in str(p)).unlink()
    code, _, err = ucp(capsys, "diff", str(a), str(b))
    assert code == 2
    assert one_error_line(err).startswith("ucp: error: [UCP-1.0-R031] ")


@pytest.mark.parametrize(
    ("shape", "chunks", "itemsize", "limit"),
    [
        ((10, 7), (4, 7), 8, 8 * 7 * 3),  # 3 rows fit, fewer than a chunk: blocks of 3
        ((10, 7), (2, 7), 8, 8 * 7 * 5),  # 5 rows fit: blocks of 4 (two whole chunks)
        ((3, 100), (1, 50), 8, 8 * 30),  # a row does not fit: cut along the last axis
        ((2, 3, 50), (1, 1, 50), 8, 8 * 20),
        ((), (), 8, 8),
        ((0, 5), (1, 5), 8, 64),
        ((17,), (5,), 2, 2 * 6),
    ],
)
def test_blocks_tile_the_tensor_once(
    shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int, limit: int
) -> None:
    seen = np.zeros(shape, np.int64)
    for starts, stops in blocks(shape, itemsize, chunks, limit):
        box = tuple(slice(a, b) for a, b in zip(starts, stops, strict=True))
        assert math.prod(b - a for a, b in zip(starts, stops, strict=True)) * itemsize <= max(
            limit, itemsize
        )
        seen[box] += 1
    assert (seen == 1).all()


def test_compare_in_small_blocks_matches_whole(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 33)).astype(ml_dtypes.bfloat16)
    y = x.copy()
    y[7, 3] = ml_dtypes.bfloat16(5.0)
    y[60, 32] = ml_dtypes.bfloat16(np.nan)
    ucpformat.save(tmp_path / "a", {"model": {"x": x}}, chunk_bytes=256)
    ucpformat.save(tmp_path / "b", {"model": {"x": y}}, chunk_bytes=256)
    with ucpformat.open(tmp_path / "a") as a, ucpformat.open(tmp_path / "b") as b:
        results = [
            compare_tensors(a["model/x"], b["model/x"], atol=0, rtol=0, tolerant=False,
                            limit=limit)
            for limit in (64, 1000, 1 << 20)
        ]
    for r in results:
        assert (r.status, r.n_different, r.max_abs) == ("different", 2, math.inf)
    assert len({(r.n_different, r.max_abs, r.max_rel) for r in results}) == 1


def test_diff_complex_and_bool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    c = np.array([1 + 2j, 3 - 1j], np.complex128)
    flags = np.array([True, False, True])
    ucpformat.save(tmp_path / "a", {"model": {"c": c, "f": flags}})
    ucpformat.save(tmp_path / "b", {"model": {"c": c + np.array([0, 1j]), "f": ~flags}})
    code, out, _ = ucp(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    status = {t["path"]: t for t in json.loads(out)["tensors"]}
    assert code == 1
    assert status["model/c"]["n_different"] == 1 and status["model/c"]["max_abs"] == 1.0
    assert status["model/f"]["n_different"] == 3 and status["model/f"]["max_abs"] == 1.0


# -- demo ------------------------------------------------------------------------------------


def test_tour_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = ucp(capsys, "tour", "--dir", str(tmp_path))
    assert code == 0, out + err
    assert "Traceback" not in out + err
    for needle in ("UCP-1.0-R041", "UCP-1.0-R031", "bit-identical", "refused:", "valid:"):
        assert needle in out
    assert ucpformat.validate(tmp_path / "demo-checkpoint", deep=True).valid
    # a second run in the same directory replaces its own checkpoints
    assert ucp(capsys, "tour", "--dir", str(tmp_path))[0] == 0


def test_tour_does_not_clobber_foreign_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "demo-checkpoint").mkdir()
    (tmp_path / "demo-checkpoint" / "precious.txt").write_text("keep me")
    code, _, err = ucp(capsys, "tour", "--dir", str(tmp_path))
    assert code == 2
    assert "not a checkpoint" in one_error_line(err)
    assert (tmp_path / "demo-checkpoint" / "precious.txt").read_text() == "keep me"


def test_every_block_iteration_is_bounded() -> None:
    """A 10 GB tensor's blocks are at most BLOCK_BYTES (no reading involved)."""
    from ucpformat.cli.diff import BLOCK_BYTES

    shape = (40_000, 65_536)  # float32: 10 GiB
    first = list(itertools.islice(blocks(shape, 8, (512, 512)), 3))
    for starts, stops in first:
        assert math.prod(b - a for a, b in zip(starts, stops, strict=True)) * 8 <= BLOCK_BYTES
    one_row = list(itertools.islice(blocks((3, 2**30), 8, (1, 2**17)), 2))
    assert one_row[0] == ([0, 0], [1, 2**23])
