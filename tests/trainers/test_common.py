"""What the trainer integrations share (ucpformat.trainers.common), in one process."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucpformat  # noqa: E402
from ucpformat.checkpoint.rank_state import RankStateWarning  # noqa: E402
from ucpformat.errors import FormatError, InvalidValueError, StorageError  # noqa: E402
from ucpformat.trainers.common import (  # noqa: E402
    decode_state,
    encode_state,
    gathered_rng,
    own_rng,
    rank_rng_extra,
    remove,
    restore_rng,
    rng_state,
    set_own_rng,
)

pytestmark = [pytest.mark.torch]


def test_trainer_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    import ucpformat.torch as ucpt

    state = {"epoch": 3, "score": torch.tensor(0.25), "kth": torch.tensor(float("inf")),
             "pair": (1, "a"), "by_id": {0: "x", 7: [1.5, float("-inf")]},
             "nested": {"path/with/slashes.ckpt": torch.tensor([1.0, 2.0],
                                                               dtype=torch.bfloat16)},
             "none": None}
    ucpt.save(tmp_path / "c", extra={"t": encode_state(state, where="training/t")})
    assert not ucpformat.validate(tmp_path / "c", deep=True).issues
    with ucpformat.open(tmp_path / "c") as ckpt:
        back = decode_state(ckpt.to_dict("training")["t"], where="t")
    assert list(back) == list(state)
    assert back["pair"] == (1, "a") and back["by_id"] == {0: "x", 7: [1.5, float("-inf")]}
    assert torch.equal(back["score"], state["score"]) and back["kth"].item() == float("inf")
    kept = back["nested"]["path/with/slashes.ckpt"]
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, state["nested"][
        "path/with/slashes.ckpt"])


def test_an_object_json_cannot_hold_is_refused_by_name() -> None:
    with pytest.raises(InvalidValueError, match=r"training/x\.hparams\.model.*Linear"):
        encode_state({"hparams": {"model": torch.nn.Linear(1, 1)}}, where="training/x")


def test_rank_generators_restore_the_draws() -> None:
    saved = gathered_rng()
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    restore_rng(rank_rng_extra(saved), rank=0, world=1)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])
    with pytest.warns(RankStateWarning) as said:
        restore_rng(rank_rng_extra(saved), rank=1, world=2)
    assert ["rank 1 finds no state of its own" in str(w.message) for w in said] == [True, False]
    assert "that of 1 process and this run has 2" in str(said[1].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restore_rng(rank_rng_extra(saved), rank=0, world=1)
    random.seed(1)  # the flat form, as a Stateful of the user's own keeps it
    set_own_rng(saved["0"])
    assert random.random() == want[0]


def test_rank_generators_are_stored_in_the_spec_per_rank_form(tmp_path: Path) -> None:
    """training/ranks/<rank>/rng in the form of training/rng (UCP-1.0-R086), valid, read
    back per rank from the checkpoint (only that rank's group)."""
    import ucpformat.torch as ucpt

    model = torch.nn.Linear(2, 2)  # (its initialisation draws from torch's generator)
    saved = gathered_rng()
    two = {"0": saved["0"], "1": saved["0"]}
    want = (random.random(), torch.rand(2))
    ucpt.save(tmp_path / "c", model=model, extra=rank_rng_extra(two))
    ckpt = ucpformat.open(tmp_path / "c")
    assert ckpt.values("training/ranks") == {"world_size": 2}
    assert ckpt.values("training/ranks/1/rng/python")["kind"] == "python"
    assert ckpt["training/ranks/1/rng/torch_cpu"].read().dtype == np.uint8
    assert not ucpformat.validate(tmp_path / "c", deep=True).issues
    random.seed(3)
    torch.manual_seed(3)
    with pytest.warns(RankStateWarning, match="2 processes and this run has 1"):
        restore_rng(tmp_path / "c", rank=1, world=1)
    got = (random.random(), torch.rand(2))
    assert want[0] == got[0] and torch.equal(want[1], got[1])


def test_another_trainers_generator_states_take_the_per_rank_form() -> None:
    """What a stock Hugging Face Trainer pickles (NumPy's legacy tuple) gives what
    own_rng() gives; what is not a generator state is refused, naming where it is."""
    np.random.rand()  # a cached Gaussian or position other than the defaults
    np.random.standard_normal()
    cpu = torch.get_rng_state()
    converted = rng_state(random.getstate(), np.random.get_state(), cpu)
    own = own_rng()
    assert sorted(converted) == sorted(own)
    for key, value in own.items():
        if isinstance(value, torch.Tensor):
            assert converted[key].dtype == value.dtype and torch.equal(converted[key], value)
        else:
            assert converted[key] == value, key
    want = (random.random(), np.random.standard_normal(), torch.rand(2))
    restore_rng(rank_rng_extra({"0": converted}), rank=0, world=1)
    got = (random.random(), np.random.standard_normal(), torch.rand(2))
    assert want[:2] == got[:2] and torch.equal(want[2], got[2])
    with pytest.raises(FormatError, match=r"rng_state_1\.pth.*Mersenne"):
        rng_state((3, (1, 2), None), np.random.get_state(), cpu, where="rng_state_1.pth")
    with pytest.raises(FormatError, match=r"rng_state_1\.pth: not the states"):
        rng_state(None, np.random.get_state(), cpu, where="rng_state_1.pth")


def test_remove_deletes_checkpoints_only(tmp_path: Path) -> None:
    import ucpformat.torch as ucpt

    ucpt.save(tmp_path / "c", extra={"a": 1})
    remove(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    (tmp_path / "f.ckpt").write_text("not a checkpoint")
    with pytest.raises(StorageError, match=r"f\.ckpt"):
        remove(tmp_path / "f.ckpt")
    assert (tmp_path / "f.ckpt").exists()
