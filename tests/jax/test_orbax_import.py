"""`ucp convert --from orbax`: Orbax's StandardCheckpointer (zarr v2 in OCDBT) and
ocp.v1 (zarr v3 in OCDBT), read through TensorStore, become a UCP checkpoint that
ucpformat.jax.load restores bit-equal, Adam state under torch's names."""

from __future__ import annotations

from pathlib import Path

import pytest

import ucpformat
import ucpformat.jax as ucpj
from tests.jax.helpers import abstract, assert_bit_equal, host_state, mesh, sharded_state
from ucpformat import importers
from ucpformat.cli import main as ucp_main

ocp = pytest.importorskip("orbax.checkpoint")


def _orbax_state() -> dict:
    state = sharded_state(mesh("2x4"))
    return {"params": state["params"], "opt_state": state["opt_state"], "step": 12}


@pytest.mark.parametrize("api", ["standard", "v1"])
def test_convert_from_orbax(tmp_path: Path, api: str) -> None:
    state = _orbax_state()
    src = tmp_path / "orbax"
    if api == "standard":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(src, state)
        checkpointer.wait_until_finished()
    else:
        ocp.v1.save(src, state)
    assert importers.detect(src) == "orbax"
    assert ucp_main(["convert", str(src), str(tmp_path / "ucp"), "--from", "orbax"]) == 0
    assert ucpformat.validate(tmp_path / "ucp", deep=True).valid
    ckpt = ucpformat.open_checkpoint(tmp_path / "ucp")
    assert "optimizer/state/blocks.layer0/exp_avg_sq" in ckpt
    host = host_state()
    target = abstract({"params": host["params"], "opt_state": host["opt_state"]}, mesh("8"),
                      rotate=1)
    got = ucpj.load(tmp_path / "ucp", {**target, "step": 0})
    assert got.pop("step") == 12
    assert_bit_equal({"params": state["params"], "opt_state": state["opt_state"]}, got)
