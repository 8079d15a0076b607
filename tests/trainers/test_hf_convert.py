"""A stock Hugging Face Trainer checkpoint, converted with ``ucp convert``, resumes in
``UCPTrainer`` bit for bit; ``UCPTrainer`` on 2 gloo processes resumes bit for bit, and
its checkpoint loads on 1 (ucpformat.importers.hf_trainer, ucpformat.trainers.transformers).

Five launches of tests/trainers/hf_convert_worker.py (a tiny GPT-2 with dropout,
shuffled data, 12 steps saving every 3): the stock Trainer on 1 and on 2 processes;
``UCPTrainer`` resumed in new processes from the converted stock checkpoints (1 and 2
processes), from its own 2-process checkpoint (2 processes), on 1 process from that
2-process checkpoint and on 2 from the converted 1-process one.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import ucpformat
from tests.trainers.launch import launch
from ucpformat import importers
from ucpformat.checkpoint.rank_state import GROUP as RANKS_GROUP
from ucpformat.cli import main
from ucpformat.errors import FormatError

pytestmark = [pytest.mark.torch, pytest.mark.distributed]
WORKER = "tests.trainers.hf_convert_worker"


def result(root: Path, name: str, rank: int = 0) -> Any:
    return json.loads((root / f"{name}-{rank}.json").read_text())


def convert(source: Path, destination: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["convert", "--allow-pickle", "--no-progress", str(source),
                 str(destination)]) == 0
    return capsys.readouterr().out


def test_stock_checkpoints_convert_and_resume_bit_equal(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One test (the launches are the cost; pytest-xdist could split a module's tests
    between workers and run a module fixture twice)."""
    root = tmp_path / "runs"
    root.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        launch(WORKER, ["stock:stock1", str(root)], root, 1, "stock1")
        launch(WORKER, ["stock:stock2", str(root)], root, 2, "stock2")
        importers.convert(root / "stock1" / "checkpoint-9", root / "conv1-9", allow_pickle=True)
        importers.convert(root / "stock2" / "checkpoint-6", root / "conv2-6", allow_pickle=True)
        launch(WORKER, [f"resume:ucp2:{root / 'conv2-6'}", str(root)], root, 2, "ucp2")
        launch(WORKER, [f"resume:again2:{root / 'ucp2' / 'checkpoint-9'},"
                        f"resume:two:{root / 'conv1-9'}", str(root)], root, 2, "again2")
        launch(WORKER, [f"resume:ucp1:{root / 'conv1-9'},"
                        f"resume:one:{root / 'ucp2' / 'checkpoint-9'}", str(root)], root, 1, "one")
    check_converted_stock_checkpoint_resumes_bit_equal(root)
    check_ucp_trainer_on_two_processes_resumes_bit_equal(root)
    check_universal_resume_two_processes_to_one_and_back(root)
    for stock, ours in [("stock1/checkpoint-12", "ucp1/checkpoint-12"),
                        ("stock2/checkpoint-12", "ucp2/checkpoint-12")]:
        check_conversion_is_what_ucp_trainer_writes(root, tmp_path / stock.replace("/", "-"),
                                                    stock, ours, capsys)
    check_refusals_name_the_file_and_why(root, tmp_path / "refusals", capsys)


def check_converted_stock_checkpoint_resumes_bit_equal(runs: Path) -> None:
    stock, resumed = result(runs, "stock1"), result(runs, "ucp1")
    assert len(stock["losses"]) == 12 and resumed["step"] == 12
    assert resumed["losses"] == stock["losses"][9:]  # mid-epoch: order and dropout restored
    assert resumed["params"] == stock["params"] and resumed["exp_avg"] == stock["exp_avg"]


def check_ucp_trainer_on_two_processes_resumes_bit_equal(runs: Path) -> None:
    for rank in (0, 1):
        stock = result(runs, "stock2", rank)
        from_converted, from_own = result(runs, "ucp2", rank), result(runs, "again2", rank)
        assert from_converted["losses"] == stock["losses"][6:]  # stock DDP -> converted
        assert from_own["losses"] == stock["losses"][9:]  # UCPTrainer's own 2-process save
        for run in (from_converted, from_own):
            assert run["params"] == stock["params"] and run["exp_avg"] == stock["exp_avg"]
    assert result(runs, "stock2", 0)["losses"] != result(runs, "stock2", 1)["losses"]
    written = sorted(p for run in ("ucp1", "ucp2", "again2", "one", "two")
                     for p in (runs / run).iterdir())
    assert len(written) == 6  # checkpoint-12 of each, and checkpoint-9 of ucp2
    for path in written:  # UCP alone: no pickle beside it, no foreign file in it
        assert sorted(p.name for p in path.iterdir()) == [
            "manifest.ucp.json", "model", "optimizer", "training", "zarr.json"]
        assert not ucpformat.validate(path, deep=True).issues, path


def assert_holds(begin: Any, checkpoint: Path) -> None:
    """The state a run started from (model, optimizer) is the one stored at ``checkpoint``."""
    with ucpformat.open(checkpoint) as ckpt:
        aliases = ckpt.groups["model"].attributes["ucp"].get("aliases", {})
        for name, value in begin["params"].items():
            stored = ckpt.tensor("model", aliases.get(name, name)).read()
            assert np.array_equal(np.asarray(value, dtype=stored.dtype), stored), name
        assert len(begin["exp_avg"]) == 16
        for name, value in begin["exp_avg"].items():
            stored = ckpt.tensor("optimizer", "state", name, "exp_avg").read()
            assert np.array_equal(np.asarray(value, dtype=stored.dtype), stored), name


def check_universal_resume_two_processes_to_one_and_back(runs: Path) -> None:
    """Saved on 2, resumed on 1, and the reverse: the state loaded is the one stored."""
    with ucpformat.open(runs / "ucp2" / "checkpoint-9") as ckpt:
        assert ckpt.values(RANKS_GROUP) == {"world_size": 2}
        assert sorted(ckpt.to_dict(RANKS_GROUP)) == ["0", "1", "world_size"]
    assert_holds(result(runs, "one")["begin"], runs / "ucp2" / "checkpoint-9")
    assert result(runs, "one")["step"] == 12
    for rank in (0, 1):
        assert_holds(result(runs, "two", rank)["begin"], runs / "conv1-9")
        assert result(runs, "two", rank)["step"] == 12


def check_conversion_is_what_ucp_trainer_writes(runs: Path, tmp_path: Path, stock: str,
                                                ours: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Same state, same names: the converted stock checkpoint and UCPTrainer's own save
    of the same step hold the same arrays, bit for bit, and the same values."""
    tmp_path.mkdir()
    out = convert(runs / stock, tmp_path / "conv", capsys)
    assert "note: not converted: training_args.bin" in out
    for path in (tmp_path / "conv", runs / ours):
        report = ucpformat.validate(path, deep=True)
        assert not report.issues, (path, report.issues)  # no foreign file either
    with ucpformat.open(tmp_path / "conv") as a, ucpformat.open(runs / ours) as b:
        assert sorted(a.arrays) == sorted(b.arrays) and sorted(a.groups) == sorted(b.groups)
        for node in a.arrays:
            x, y = a[node], b[node]
            assert dict(x.attributes) == dict(y.attributes), node  # the role, a layout
            assert (x.dtype, x.read().tobytes()) == (y.dtype, y.read().tobytes()), node
        for group in a.groups:
            expected = dict(b.values(group))
            if group == "optimizer":  # the class is in training_args.bin, a pickle not read
                assert expected.pop("type") == "torch.optim.adamw.AdamW"
            assert a.values(group) == expected, group
        assert a.groups["model"].attributes["ucp"]["aliases"] == {
            "lm_head.weight": "transformer.wte.weight"}
        assert a.groups["model"].attributes == b.groups["model"].attributes


def check_refusals_name_the_file_and_why(runs: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "checkpoint-9"
    shutil.copytree(runs / "stock1" / "checkpoint-9", source)
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "optimizer.pt, scheduler.pt, rng_state.pth are pickles" in err
    assert "--allow-pickle" in err and "--weights-only" in err
    # --weights-only still converts the weights alone, naming what it left
    assert main(["convert", "--weights-only", "--no-progress", str(source),
                 str(tmp_path / "weights")]) == 0
    assert "optimizer.pt, rng_state.pth, scheduler.pt" in capsys.readouterr().out
    with ucpformat.open(tmp_path / "weights") as ckpt:
        assert "optimizer" not in ckpt.groups

    def refused(match: str) -> None:
        with pytest.raises(FormatError, match=match):
            importers.convert(source, tmp_path / "out", allow_pickle=True)
        assert not (tmp_path / "out").exists()

    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLM"]}))
    refused(r"config\.json.*unknown architecture 'NoSuchLM'")
    (source / "config.json").write_text(json.dumps({**config, "n_embd": 12}))
    refused(r"model/transformer\.wte\.weight: shape \[32, 8\] in the weights, \[32, 12\]")
    (source / "config.json").unlink()
    refused(r"no config\.json: optimizer\.pt numbers the parameters")
    (source / "config.json").write_text(json.dumps({**config, "n_layer": 2}))
    refused(r"transformer\.h\.1\..*the weights do not")
    (source / "config.json").write_text(json.dumps(config))
    import torch

    opt = torch.load(source / "optimizer.pt", weights_only=True)
    opt["param_groups"][0]["params"].pop()
    torch.save(opt, source / "optimizer.pt")
    refused(r"optimizer\.pt.*param groups of \[5, 10\] parameters.*builds 2 of \[6, 10\]")
    opt = torch.load(runs / "stock1" / "checkpoint-9" / "optimizer.pt", weights_only=True)
    opt["state"][0], opt["state"][1] = opt["state"][1], opt["state"][0]  # wte's <-> wpe's
    torch.save(opt, source / "optimizer.pt")
    refused(r"optimizer/state/transformer\.wte\.weight/exp_avg.*parameter 0 is "
            r"transformer\.wte\.weight.*shape \[32, 8\].*has shape \[8, 8\]")
    shutil.copy(runs / "stock1" / "checkpoint-9" / "optimizer.pt", source / "optimizer.pt")
    (source / "scheduler.pt").unlink()
    refused(r"scheduler\.pt missing")
    # save_only_model: the weights and the trainer state, as UCPTrainer saves them then
    (source / "optimizer.pt").unlink()
    (source / "rng_state.pth").unlink()
    importers.convert(source, tmp_path / "model-only")
    with ucpformat.open(tmp_path / "model-only") as ckpt:
        assert sorted(ckpt.groups) == ["model", "training"]
        training = ckpt.to_dict("training")
        assert sorted(training) == ["step", "trainer_state"] and training["step"] == 9
        assert ckpt.groups["model"].attributes["ucp"]["aliases"] == {
            "lm_head.weight": "transformer.wte.weight"}
