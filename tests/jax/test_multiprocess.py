"""Two real jax.distributed processes on CPU (4 virtual devices each): they save and one
process loads; one process saves and they load; one of them fails mid-save."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import ucpformat
import ucpformat.jax as ucpj
from tests.jax.helpers import abstract, assert_bit_equal, host_state, mesh, sharded_state
from ucpformat.errors import UCPError

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
def test_two_processes_save_load_and_fail(tmp_path: Path) -> None:
    # one process, 8 devices, saves what the two processes will load
    single = sharded_state(mesh("8"))
    ucpj.save(tmp_path / "single", single, step=4)

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.jax.mp_worker", str(pid), str(port),
                               str(tmp_path)], cwd=REPO, env=env)
             for pid in range(2)]
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = [json.loads((tmp_path / f"result-{pid}.json").read_text()) for pid in range(2)]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["devices"] == 8 and r["local"] == 4

    # the two processes' save: complete, valid, bit-equal on one process's (1, 8) mesh
    report = ucpformat.validate(tmp_path / "mp", deep=True)
    assert report.valid and not report.issues, report.issues
    assert all(r["saved_bytes"] > 0 for r in results)  # each wrote its own part
    expected = sharded_state(mesh("2x4"))
    got = ucpj.load(tmp_path / "mp", {**abstract(expected, mesh("1x8"), rotate=1), "step": 0})
    assert got.pop("step") == 9
    assert_bit_equal(expected, got)

    # each process loaded its own shards of the one-process save, and asked for less than
    # all (the boxes of its own devices)
    for r in results:
        assert r["mismatched"] == [] and r["step"] == 4
        assert 0 < r["requested"] < r["elements"], r

    # process 1 failed: both raised, nothing new committed, the previous checkpoint kept
    for r in results:
        assert r["failed_save_fail"] != "committed" and r["failed_save_mp"] != "committed"
    assert "injected failure on process 1" in results[1]["failed_save_fail"]
    assert "rank 1" in results[0]["failed_save_fail"]
    with pytest.raises(UCPError):
        ucpformat.open_checkpoint(tmp_path / "fail")
    assert not [p for p in (tmp_path / "fail").rglob("*") if p.is_file()] if (
        tmp_path / "fail").exists() else True
    again = ucpj.load(tmp_path / "mp", {**abstract(expected, mesh("8"), rotate=2), "step": 0})
    assert again.pop("step") == 9
    assert_bit_equal(host_state(), again)
