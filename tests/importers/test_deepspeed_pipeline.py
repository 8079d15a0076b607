"""DeepSpeed pipeline parallelism (``layer_*`` files) -> UCP, against real DeepSpeed 0.19.8 runs.

The runs (``tests/importers/ds_pipeline.py``, 4 gloo ranks, ZeRO-1, ``torch_adam``):
2 stages x 2 data-parallel ranks of a small net (fp32 and bf16; flat partitions that cut
through parameters; an embedding tied to the head; buffers), and 2 stages x 2
tensor-parallel ranks of a Megatron-DeepSpeed-style GPT (grouped-query fused QKV, fused
SwiGLU, padded vocabulary-parallel embedding tied to the head).

References: DeepSpeed's own ``ds_to_universal`` (fp32 master weights and Adam moments;
it handles pipeline checkpoints), and what each rank's engine held after training (its
module's weights and buffers, ``safe_get_full_fp32_param`` and
``safe_get_full_optimizer_state``): ``zero_to_fp32`` cannot read pipeline checkpoints.
Everything is compared bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.importers.conftest import assert_same, bits, cached_framework_run, shared_cache
from ucpformat import importers
from ucpformat.distributed.framework import ModelLayout
from ucpformat.format import names
from ucpformat.layout.rank_slices import ParallelConfig, RankCoords
from ucpformat.layout.rules import RuleSet

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

from tests.importers.ds_pipeline import (  # noqa: E402  (needs torch)
    CORE_RUNS,
    GPT,
    GPT_RUNS,
    PIPE_RUNS,
    STEPS,
    gpt_canonical_qkv,
)

GPT_RUN = GPT_RUNS[0]
RULE_PARAMS = {k: GPT[k] for k in ("num_attention_heads", "num_query_groups", "kv_channels",
                                   "ffn_hidden_size")} | {"gated_linear_unit": True}
RULES = {"rules": "megatron-deepspeed-gpt", "rule_params": RULE_PARAMS}
#: the imports: each run as is, and the GPT runs through the megatron-deepspeed-gpt rule file
CORE_PARAMS = RULE_PARAMS | {"vocab_size": GPT["vocab_size"], "tie_word_embeddings": False}
IMPORTS = {run: (run, {}) for run in PIPE_RUNS + GPT_RUNS} | {
    f"{run}+rules": (run, RULES) for run in GPT_RUNS} | {
    run: (run, {"rules": "megatron-gpt", "rule_params": CORE_PARAMS}) for run in CORE_RUNS}
GPT_RULES = GPT_RUN + "+rules"
#: runs ds_to_universal converts (it refuses the bf16 optimizer's files: no param_shapes)
UNIVERSAL = [key for key, (run, _) in IMPORTS.items()
             if "zero0" not in run and run not in CORE_RUNS]
#: GPTModelPipe's layers: the cast (0), embedding (1), 4 transformer layers, norm (6), head (7)
GPT_LAYERS = 8


@pytest.fixture(scope="session")
def pp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_framework_run(tmp_path_factory, "deepspeed-pp")


@pytest.fixture(scope="session")
def imported(pp_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    def build(base: Path) -> None:
        for key, (run, kwargs) in IMPORTS.items():
            importers.convert(pp_runs / run, base / key, durable=False, **kwargs)

    base = shared_cache(tmp_path_factory, "ds-pp-imported", build)
    return {key: base / key for key in IMPORTS}


def _engines(pp_runs: Path, run: str) -> list[dict[str, Any]]:
    return [torch.load(f, weights_only=True)
            for f in sorted((pp_runs / run / "engine").glob("rank*.pt"))]


def _fp32(ckpt: ucpformat.Checkpoint, name: str) -> np.ndarray[Any, Any]:
    if ckpt.tensor("model", name).meta.dtype.name == "float32":
        return ckpt.tensor("model", name).read()
    return ckpt.tensor("optimizer", "state", name, "master").read()


def test_deepspeed_tools_on_pipeline_checkpoints(pp_runs: Path) -> None:
    """What the docs say: ds_to_universal handles them; zero_to_fp32 cannot read them."""
    for run in PIPE_RUNS + GPT_RUNS:
        said = json.loads((pp_runs / run / "tools.json").read_text())
        if "zero0" in run:
            assert "param_shapes must contain dictionaries" in said["ds_to_universal"], said
        else:
            assert said["ds_to_universal"] == "ok"
        assert said["zero_to_fp32"].startswith("AttributeError"), said


@pytest.mark.parametrize("key", UNIVERSAL)
def test_import_equals_ds_to_universal(pp_runs: Path, imported: dict[str, Path],
                                       key: str) -> None:
    run = IMPORTS[key][0]
    assert ucpformat.validate(imported[key], deep=True).valid
    ckpt = ucpformat.open(imported[key])
    checked = 0
    for pdir in sorted(p for p in (pp_runs / run / "universal" / "zero").iterdir()
                       if p.is_dir()):
        name = pdir.name
        for f in sorted(pdir.glob("*.pt")):
            value = torch.load(f, weights_only=False)
            want = value["param"] if isinstance(value, dict) else value
            got = (_fp32(ckpt, name) if f.stem == "fp32"
                   else ckpt.tensor("optimizer", "state", name, f.stem).read())
            if key.endswith("+rules") and "query_key_value" in name and f.stem != "step":
                want = gpt_canonical_qkv(want)  # ds_to_universal keeps Megatron's interleaving
            assert_same(got, want, f"{key} {name}/{f.stem}")
            checked += 1
    assert checked >= 28


@pytest.mark.parametrize("run", PIPE_RUNS)
def test_import_equals_the_engines(pp_runs: Path, imported: dict[str, Path], run: str) -> None:
    """Every rank's module weights, buffers, master weights and moments, bit for bit."""
    ckpt = ucpformat.open(imported[run])
    seen = set()
    for engine in _engines(pp_runs, run):
        for key, want in engine.items():
            if key == "coords":
                continue
            kind, name = key.split("/", 1)
            if kind in ("module", "buffer"):
                got = ckpt.tensor("model", name).read()
            elif kind == "fp32":
                got = _fp32(ckpt, name)
            else:
                got = ckpt.tensor("optimizer", "state", name, kind).read()
            assert_same(got, want, f"{run} rank {engine['coords']}: {key}")
            seen.add(name)
    assert "tied_modules.embed.weight" in seen and "3.running" in seen
    dtype = "bfloat16" if run.endswith("bf16") else "float32"
    assert ckpt.tensor("model", "2.fc.weight").meta.dtype.name == dtype


def test_pipeline_names_layers_and_optimizer(imported: dict[str, Path]) -> None:
    ckpt = ucpformat.open(imported["pp2-dp2-zero1-bf16"])
    layout = {t.name: dict(t.attributes).get("layout") for t in ckpt.tensors("model")}
    assert layout["3.fc.weight"] == {"layer": 3}  # global: stage 1's first layer
    assert layout["tied_modules.embed.weight"] is None
    assert ckpt.tensor("model", "1.running").attributes["role"] == "buffer"
    assert ckpt.values("training")["step"] == STEPS
    source = ckpt.metadata["source"]
    assert (source["pp_world_size"], source["tp_world_size"], source["dp_world_size"]) == (2, 1, 2)
    assert source["pp_stage_layers"] == [[1, 2], [3, 3]]
    groups = ckpt.values("optimizer")["param_groups"]
    assert groups[0]["params"] == ["tied_modules.embed.weight", "1.fc.weight", "1.fc.bias",
                                   "2.fc.weight", "2.fc.bias", "3.fc.weight", "3.fc.bias"]
    assert ckpt.values("optimizer")["master_weights"] == "master"


# -- the tensor-parallel GPT ------------------------------------------------------------------


def _gpt_layout(ckpt: ucpformat.Checkpoint, cfg: ParallelConfig) -> ModelLayout:
    params = ckpt.metadata["source"]["rule_params"]
    assert params["vocab_size"] == GPT["vocab_size"]  # from universal_checkpoint_info
    return ModelLayout(RuleSet.load("megatron-deepspeed-gpt"),
                       params | {"vocab_multiple": GPT["vocab_multiple"]}, cfg)


def test_gpt_layout_semantics(imported: dict[str, Path]) -> None:
    ckpt = ucpformat.open(imported[GPT_RULES])
    h, heads, groups, kv = (GPT["hidden_size"], GPT["num_attention_heads"],
                            GPT["num_query_groups"], GPT["kv_channels"])
    qkv = ckpt.tensor("model", "4.self_attention.query_key_value.weight")
    assert qkv.shape == ((heads + 2 * groups) * kv, h)
    assert qkv.attributes["layout"] == {
        "tp": {"dim": 0}, "groups": groups, "layer": 4,
        "parts": [{"name": "q", "size": heads * kv}, {"name": "k", "size": groups * kv},
                  {"name": "v", "size": groups * kv}]}
    fc1 = ckpt.tensor("model", "2.mlp.dense_h_to_4h.weight").attributes["layout"]
    assert fc1["parts"] == [{"name": "gate", "size": 24}, {"name": "up", "size": 24}]
    emb = ckpt.tensor("model", "tied_modules.embed.word_embeddings.weight")
    assert emb.shape == (GPT["vocab_size"], h)  # padding dropped (R113)
    assert emb.attributes["layout"] == {"tp": {"dim": 0}, "vocab": {"dim": 0}}
    assert ckpt.tensor("model", "6.weight").attributes["layout"] == {"layer": 6}
    assert ckpt.tensor("model", "3.self_attention.dense.weight").attributes["layout"] == {
        "tp": {"dim": 1}, "layer": 3}
    # without the rule file: what universal_checkpoint_info says (Megatron's interleaved QKV)
    plain = ucpformat.open(imported[GPT_RUN])
    assert plain.tensor("model", "4.self_attention.query_key_value.weight").attributes[
        "layout"] == {"tp": {"dim": 0}, "layer": 4}
    assert plain.tensor("model", "2.mlp.dense_h_to_4h.weight").attributes["layout"]["parts"] == [
        {"name": "0", "size": 24}, {"name": "1", "size": 24}]


@pytest.mark.parametrize("run", GPT_RUNS)
def test_gpt_round_trips_to_every_source_rank(pp_runs: Path, imported: dict[str, Path],
                                              run: str) -> None:
    """The layout loader rebuilds each rank's local tensors as its engine held them."""
    ckpt = ucpformat.open(imported[run + "+rules"])
    bf16 = run.endswith("bf16")
    cfg = ParallelConfig(tp=2, pp=2, num_layers=GPT_LAYERS, pp_layers=(4, 4))
    layout = _gpt_layout(ckpt, cfg)
    engines = _engines(pp_runs, run)
    assert len(engines) == 4
    for engine in engines:
        c = engine["coords"]
        rank = cfg.rank(RankCoords(tp=c["tp"], pp=c["pp"]))
        module = layout.local_state(ckpt, rank)
        want_names = {k.split("/", 1)[1] for k in engine if k.startswith("module/")}
        assert set(module) == want_names
        if c["pp"] == 1:
            # the last stage's copy of the tied module: DeepSpeed keeps only the tied
            # attribute (word_embeddings.weight) in step; its unused position embeddings
            # never train there. The first stage's copy is the model's (and what is stored).
            stale = "tied_modules.embed.position_embeddings.weight"
            assert not np.array_equal(bits(module[stale]), bits(engine[f"module/{stale}"]))
            want_names.remove(stale)
        for name in want_names:
            # vocabulary padding rows: the engine's stayed 0 (never used), the loader fills 0
            assert_same(module[name], engine[f"module/{name}"], f"{c}: {name}")
        for state, kind in (("master", "fp32"), ("exp_avg", "exp_avg"),
                            ("exp_avg_sq", "exp_avg_sq")):
            path = ("model/{}" if state == "master" and not bf16
                    else f"optimizer/state/{{}}/{state}")
            local = layout.local_state(
                ckpt, rank, path_of=lambda n, p=path: p.format(names.escape(n)))
            for name in want_names:
                assert_same(local[name], engine[f"{kind}/{name}"], f"{c}: {kind} {name}")


def _group_major(canonical: np.ndarray[Any, Any], mine: range) -> np.ndarray[Any, Any]:
    """Megatron's local QKV rows of query groups ``mine`` from the canonical [q; k; v]."""
    heads, groups, kv = GPT["num_attention_heads"], GPT["num_query_groups"], GPT["kv_channels"]
    q_rows = heads // groups * kv
    q, k, v = np.split(canonical, [heads * kv, (heads + groups) * kv])
    return np.concatenate([np.concatenate([q[g * q_rows:(g + 1) * q_rows],
                                           k[g * kv:(g + 1) * kv], v[g * kv:(g + 1) * kv]])
                           for g in mine])


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (4, 1), (1, 2)])
def test_gpt_loads_into_other_layouts(imported: dict[str, Path], tp: int, pp: int) -> None:
    """TP=1 and TP=4 (trained with TP=2 x PP=2): local tensors equal direct slicing."""
    ckpt = ucpformat.open(imported[GPT_RULES])
    cfg = ParallelConfig(tp=tp, pp=pp, num_layers=GPT_LAYERS)
    layout = _gpt_layout(ckpt, cfg)
    full = {t.name: t.read() for t in ckpt.tensors("model")}
    groups, f = GPT["num_query_groups"], GPT["ffn_hidden_size"]
    step = GPT["vocab_multiple"] * tp
    padded = -(-GPT["vocab_size"] // step) * step
    for rank in range(cfg.world):
        c = cfg.coords(rank)
        local = layout.local_state(ckpt, rank)
        stage = cfg.stage_layers(c.pp)
        want_names = {n for n in full if not n[0].isdigit() or int(n.split(".")[0]) in stage}
        assert set(local) == want_names, c
        for name, value in full.items():
            if name not in want_names:
                continue
            r = c.tp
            if "query_key_value" in name:
                want = _group_major(value, range(r * groups // tp, (r + 1) * groups // tp))
            elif "dense_h_to_4h" in name:
                gate, up = value[:f], value[f:]
                n = f // tp
                want = np.concatenate([gate[r * n:(r + 1) * n], up[r * n:(r + 1) * n]])
            elif name.endswith(("dense.weight", "dense_4h_to_h.weight")):
                want = np.split(value, tp, axis=1)[r]
            elif name == "tied_modules.embed.word_embeddings.weight":
                pad = np.zeros((padded, value.shape[1]), value.dtype)
                pad[:value.shape[0]] = value
                want = np.split(pad, tp)[r]
            else:
                want = value  # replicated
            assert_same(local[name], want, f"tp={tp} pp={pp} {c}: {name}")


def test_a_rule_file_that_does_not_fit_is_refused(pp_runs: Path, tmp_path: Path) -> None:
    with pytest.raises(ucpformat.errors.LayoutError, match="query_key_value"):
        importers.convert(pp_runs / GPT_RUN, tmp_path / "ckpt", rules="megatron-deepspeed-gpt",
                          rule_params=RULE_PARAMS | {"num_query_groups": 8})


# -- megatron-core names under DeepSpeed tensor parallelism (no pipeline) ---------------------


@pytest.mark.parametrize("run", CORE_RUNS)
def test_megatron_gpt_rules_under_deepspeed_tp(pp_runs: Path, imported: dict[str, Path],
                                               tmp_path: Path, run: str) -> None:
    """mp_rank_00/01 (TP=2) x 2 ZeRO-2 partitions each, through the megatron-gpt rule file."""
    assert ucpformat.validate(imported[run], deep=True).valid
    ckpt = ucpformat.open(imported[run])
    qkv = ckpt.tensor("model", "decoder.layers.3.self_attention.linear_qkv.weight")
    assert qkv.attributes["layout"]["parts"][0] == {"name": "q", "size": 32}
    assert qkv.meta.dtype.name == "bfloat16"
    assert ckpt.tensor("model", "output_layer.weight").shape == (GPT["vocab_size"], 32)
    source = ckpt.metadata["source"]
    assert (source["tp_world_size"], source["dp_world_size"], source["zero_stage"]) == (2, 2, 2)
    cfg = ParallelConfig(tp=2)
    layout = ModelLayout(RuleSet.load("megatron-gpt"),
                         CORE_PARAMS | {"vocab_multiple": GPT["vocab_multiple"]}, cfg)
    engines = _engines(pp_runs, run)
    assert len(engines) == 4
    for engine in engines:
        t = engine["coords"]["tp"]
        names_ = {k.split("/", 1)[1] for k in engine if k.startswith("module/")}
        for kind, path in (("module", "model/{}"), ("fp32", "optimizer/state/{}/master"),
                           ("exp_avg", "optimizer/state/{}/exp_avg"),
                           ("exp_avg_sq", "optimizer/state/{}/exp_avg_sq")):
            local = layout.local_state(ckpt, t, path_of=None if kind == "module" else
                                       (lambda n, p=path: p.format(names.escape(n))))
            assert set(local) == names_
            for name in names_:
                assert_same(local[name], engine[f"{kind}/{name}"], f"tp{t}: {kind} {name}")
    with pytest.raises(ucpformat.errors.UnsupportedFeatureError, match="rule file"):
        importers.convert(pp_runs / run, tmp_path / "no-rules")


def test_cli_converts_a_pipeline_run_through_a_rule_file(pp_runs: Path, tmp_path: Path) -> None:
    from ucpformat.importers.cli import main

    assert importers.detect(pp_runs / GPT_RUN) == "deepspeed"
    args = ["convert", str(pp_runs / GPT_RUN), str(tmp_path / "ckpt"), "--no-progress",
            "--tag", f"global_step{STEPS}", "--rules", "megatron-deepspeed-gpt"]
    for key, value in RULE_PARAMS.items():
        args += ["--rule-param", f"{key}={json.dumps(value)}"]
    assert main(args) == 0
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert ckpt.tensor("model", "5.self_attention.query_key_value.bias").attributes[
        "layout"]["groups"] == GPT["num_query_groups"]
