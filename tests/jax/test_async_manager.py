"""save_async returns once the values are on the host; the CheckpointManager runs JAX
saves (periodic, async, retention, restore)."""

from __future__ import annotations

from pathlib import Path

import jax

import ucpformat
import ucpformat.jax as ucpj
from tests.jax.helpers import abstract, assert_bit_equal, host_state, mesh, sharded_state
from ucpformat.checkpoint.manager import CheckpointManager


def test_async_save_needs_no_device_buffer_once_it_returns(tmp_path: Path) -> None:
    state = sharded_state(mesh("2x4"))
    future = ucpj.save_async(tmp_path / "c", state, step=1)
    # the device buffers are freed at once: the write works from the host copies
    for leaf in jax.tree_util.tree_leaves(state):
        if isinstance(leaf, jax.Array) and not jax.dtypes.issubdtype(
                leaf.dtype, jax.dtypes.prng_key):
            leaf.delete()
    result = future.result(timeout=120)
    assert result.tensors > 0
    assert ucpformat.validate(tmp_path / "c", deep=True).valid
    got = ucpj.load(tmp_path / "c", {**abstract(host_state(), mesh("8"), rotate=2), "step": 0})
    assert got.pop("step") == 1
    assert_bit_equal(host_state(), got)


def test_the_manager_keeps_the_last_async_jax_saves_and_restores(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "run", save_every=2, keep_last=2)
    state = sharded_state(mesh("2x4"))
    for step in range(7):
        if step:
            state = {**state, "params": jax.tree_util.tree_map(lambda p: p + 1, state["params"])}
        manager.maybe_save(step, lambda path, s=state, n=step: ucpj.save_async(path, s, step=n))
    manager.close()
    assert manager.all_steps() == [4, 6]
    latest = manager.latest_step()
    assert latest == 6
    target = {**abstract(state, mesh("1x8"), rotate=4), "step": 0}
    with manager.restore() as ckpt:
        got = ucpj.load(ckpt, target)
    assert got.pop("step") == 6
    assert_bit_equal(state, got)
