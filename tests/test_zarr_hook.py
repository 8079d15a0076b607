"""Plain zarr-python reads bfloat16 and float8 arrays in an interpreter that never imports
ucpformat, through the import hook the wheel installs (hooks/, docs/zarr-python.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ucpformat
from ucpformat.format import zarr_dtypes

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "hooks"
TYPES = {"w16": ml_dtypes.bfloat16, "w8": ml_dtypes.float8_e4m3fn, "w5": ml_dtypes.float8_e5m2}


def run(script: str, site: Path | None) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter whose site-packages are on the path without their
    .pth files (so the hook an installed wheel put there does not run: ``-S``); with
    ``site``, that directory is a site directory (its .pth files processed as they are in
    site-packages)."""
    packages = [p for p in sys.path if p.endswith("site-packages")]
    prelude = f"import site, sys; sys.path.extend({packages!r})\n"
    if site:
        prelude += f"site.addsitedir({str(site)!r})\n"
    return subprocess.run(
        [sys.executable, "-S", "-c", prelude + textwrap.dedent(script)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site directory holding what the wheel puts at its root (pyproject force-include)."""
    out = tmp_path / "site"
    out.mkdir()
    for source, target in wheel_root_files().items():
        shutil.copy(REPO / source, out / target)
    return out


def wheel_root_files() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    force = project["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    return {src: dst for src, dst in force.items() if src.startswith("hooks/")}


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    model = {name: rng.standard_normal((6, 5)).clip(-400, 400).astype(t)
             for name, t in TYPES.items()}
    ucpformat.save(tmp_path / "ckpt", {"model": model}, durable=False)
    bits = {k: v.view(f"u{v.dtype.itemsize}").ravel().tolist() for k, v in model.items()}
    return tmp_path / "ckpt", bits


READ = """
    import json, sys
    import zarr
    assert "ucpformat" not in sys.modules, "imported at start-up"
    group = zarr.open_group({path!r}, mode="r")
    out = {{}}
    for name in {names!r}:
        a = group["model"][name][...]
        out[name] = [a.dtype.name, a.view("u%d" % a.dtype.itemsize).ravel().tolist()]
    # and writing: zarr matches an ml_dtypes numpy type to its data type
    import ml_dtypes, numpy as np
    z = zarr.create_array({scratch!r}, shape=(3,), dtype=ml_dtypes.bfloat16)
    z[...] = np.array([1, 2, 3], dtype=ml_dtypes.bfloat16)
    out["written"] = zarr.open_array({scratch!r}, mode="r").metadata.data_type.to_json(
        zarr_format=3)
    print(json.dumps(out))
"""


def test_plain_zarr_reads_bfloat16_and_float8_through_the_hook(
    site: Path, ckpt: tuple[Path, dict[str, list[int]]], tmp_path: Path
) -> None:
    path, bits = ckpt
    proc = run(READ.format(path=str(path), names=sorted(TYPES), scratch=str(tmp_path / "z")),
               site)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name, dtype in TYPES.items():
        assert got[name] == [np.dtype(dtype).name, bits[name]], name
    assert got["written"] == "bfloat16"


def test_without_the_hook_zarr_does_not_load_its_entry_points(
    ckpt: tuple[Path, dict[str, list[int]]], tmp_path: Path
) -> None:
    """What the hook works around (zarr-python 3.1.x, 3.2.x): if this starts to pass
    without the hook, zarr loads its entry points at last; update docs/zarr-python.md."""
    path, _ = ckpt
    proc = run(READ.format(path=str(path), names=["w16"], scratch=str(tmp_path / "z")), None)
    assert proc.returncode != 0
    assert "No Zarr data type found that matches 'bfloat16'" in proc.stderr


def test_the_hook_costs_one_module_at_start_up(site: Path) -> None:
    proc = run("""
        import sys
        print(sorted(m for m in sys.modules if "zarr" in m or "ucpformat" in m
                     or m in ("numpy", "typing", "importlib.util", "importlib.metadata")))
    """, site)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.replace("'", '"')) == ["_ucpformat_zarr"]


def test_the_wheel_ships_the_hook_and_declares_every_data_type() -> None:
    files = wheel_root_files()
    assert set(files.values()) == {"_ucpformat_zarr.py", "ucpformat-zarr.pth"}
    pth = (REPO / next(s for s, d in files.items() if d.endswith(".pth"))).read_text()
    assert pth.strip() == "import _ucpformat_zarr"
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    declared = project["project"]["entry-points"]["zarr.data_type"]
    assert {name: value.partition(":")[0] for name, value in declared.items()} == {
        cls._zarr_v3_name: "ucpformat.format.zarr_dtypes" for cls in zarr_dtypes.PLUGINS}


def test_a_first_write_finds_its_data_type_through_the_hook(site: Path, tmp_path: Path) -> None:
    """zarr's first lookup a numpy type (match_dtype walks the whole registry: the
    stand-ins are replaced in place while it does)."""
    proc = run(f"""
        import sys
        import ml_dtypes, numpy as np, zarr
        z = zarr.create_array({str(tmp_path / "z")!r}, shape=(4,), dtype=ml_dtypes.float8_e5m2)
        z[...] = np.array([1, 2, 3, -448], dtype=ml_dtypes.float8_e5m2)
        back = zarr.open_array({str(tmp_path / "z")!r}, mode="r")
        print(back.metadata.data_type.to_json(zarr_format=3), back[...].astype(float).tolist(),
              "ucpformat" in sys.modules)
    """, site)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["float8_e5m2", "[1.0,", "2.0,", "3.0,", "-448.0]", "True"]
