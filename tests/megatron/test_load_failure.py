"""A Megatron load that meets a damaged chunk says what happened to the caller's state
(issue 29, item 11): UCPLoadStrategy reads into tensors of its own, so nothing of the
model, the optimizer or the sharded state dict changed, and the error says so (it said
the model and the optimizer were partly changed). One process, the strategies alone."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

from ucpformat.errors import ChecksumError  # noqa: E402
from ucpformat.megatron.strategies import UCPLoadStrategy, UCPSaveStrategy  # noqa: E402

pytestmark = pytest.mark.torch

KEYS = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")


def _state(values: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in values.items()}


def test_damaged_chunk_leaves_the_state_and_says_so(tmp_path: Path) -> None:
    saved = {k: torch.arange(64, dtype=torch.float32) + i for i, k in enumerate(KEYS)}
    UCPSaveStrategy({}, durable=False).save(_state(saved), tmp_path / "ckpt")
    victim = next(p for p in (tmp_path / "ckpt").rglob("*")
                  if p.is_file() and "final_layernorm.bias" in str(p) and p.name != "zarr.json")
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 0x40
    victim.write_bytes(bytes(raw))

    model = {k: torch.full((64,), -1.0) for k in KEYS}  # the caller's parameters
    request = _state(model)
    with pytest.raises(ChecksumError) as info:
        UCPLoadStrategy().load(request, tmp_path / "ckpt")
    message = str(info.value)
    assert "partly changed" not in message and "make the state whole" not in message
    assert "nothing was changed" in message
    assert "model/decoder.final_layernorm.bias" in message  # the damaged tensor, by name
    for k in KEYS:  # and indeed nothing was
        assert torch.equal(model[k], torch.full((64,), -1.0)), k
        assert isinstance(request[k], ShardedTensor) and request[k].data is model[k], k
