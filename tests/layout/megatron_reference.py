"""A reference model sharded the way Megatron-style frameworks shard it, written independently.

The ground truth is the consolidated state (global names, unpadded vocabulary, fused
tensors part after part). :func:`shard` builds one rank's local state with plain numpy,
following the frameworks' own conventions directly (QKV interleaved per query group,
gate/up per rank, padded vocabulary split across ranks, stage-local layer numbers,
rank-local expert numbers, ZeRO-1 flat partitions, ZeRO-3 dim-0 partitions) - on purpose
without ucpformat's layout code, so the matrix test checks that code against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ucpformat.layout.rank_slices import ParallelConfig


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 16
    heads: int = 8
    groups: int = 4  # query groups (GQA)
    kv: int = 2  # head dim
    ffn: int = 24  # gated: fc1 has 2 * ffn rows (gate, up)
    moe_ffn: int = 8
    experts: int = 4
    layers: int = 4
    moe_layers: tuple[int, ...] = (1, 3)
    vocab: int = 50
    vocab_multiple: int = 8
    tied: bool = False

    def params(self) -> dict[str, Any]:
        return {
            "num_attention_heads": self.heads,
            "num_query_groups": self.groups,
            "kv_channels": self.kv,
            "ffn_hidden_size": self.ffn,
            "moe_ffn_hidden_size": self.moe_ffn,
            "num_experts": self.experts,
            "vocab_size": self.vocab,
            "gated_linear_unit": True,
            "tie_word_embeddings": self.tied,
            "vocab_multiple": self.vocab_multiple,
        }


OPT_KINDS = ("master_param", "exp_avg", "exp_avg_sq")


def ground_truth(mc: ModelConfig, seed: int = 0) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
    """Consolidated state: bf16 parameters and fp32 optimizer state per parameter."""
    rng = np.random.default_rng(seed)
    h, q, kv = mc.hidden, mc.heads * mc.kv, mc.groups * mc.kv
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (mc.vocab, h)}
    for i in range(mc.layers):
        p = f"decoder.layers.{i}"
        shapes[f"{p}.self_attention.linear_qkv.weight"] = (q + 2 * kv, h)
        shapes[f"{p}.self_attention.linear_qkv.bias"] = (q + 2 * kv,)
        shapes[f"{p}.self_attention.linear_proj.weight"] = (h, q)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.pre_mlp_layernorm.weight"] = (h,)
        if i in mc.moe_layers:
            shapes[f"{p}.mlp.router.weight"] = (mc.experts, h)
            for e in range(mc.experts):
                shapes[f"{p}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * mc.moe_ffn, h)
                shapes[f"{p}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, mc.moe_ffn)
        else:
            shapes[f"{p}.mlp.linear_fc1.weight"] = (2 * mc.ffn, h)
            shapes[f"{p}.mlp.linear_fc2.weight"] = (h, mc.ffn)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not mc.tied:
        shapes["output_layer.weight"] = (mc.vocab, h)
    model = {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in shapes.items()}
    opt = {
        kind: {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        for kind in OPT_KINDS
    }
    return {"model": model, **opt}


# -- direct sharding, Megatron conventions ------------------------------------------------


def _coords(cfg: ParallelConfig, rank: int) -> tuple[int, int, int]:
    tp = rank % cfg.tp
    dp = (rank // cfg.tp) % cfg.dp
    pp = rank // (cfg.tp * cfg.dp)
    return tp, dp, pp


def _rows(x: np.ndarray[Any, Any], ways: int, i: int, axis: int = 0) -> np.ndarray[Any, Any]:
    return np.split(x, ways, axis=axis)[i]


def _tp_local(
    name: str, full: np.ndarray[Any, Any], mc: ModelConfig, tp: int, r: int
) -> np.ndarray[Any, Any]:
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        step = mc.vocab_multiple * tp
        padded_rows = math.ceil(full.shape[0] / step) * step
        pad = np.zeros((padded_rows - full.shape[0], *full.shape[1:]), dtype=full.dtype)
        return _rows(np.concatenate([full, pad]), tp, r)
    if "linear_qkv" in name:
        q, kv = mc.heads * mc.kv, mc.groups * mc.kv
        g = mc.groups
        qs = full[:q].reshape(g, q // g, *full.shape[1:])
        ks = full[q : q + kv].reshape(g, kv // g, *full.shape[1:])
        vs = full[q + kv :].reshape(g, kv // g, *full.shape[1:])
        interleaved = np.concatenate([qs, ks, vs], axis=1).reshape(full.shape)
        return _rows(interleaved, tp, r)
    if "linear_fc1" in name:
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([_rows(gate, tp, r), _rows(up, tp, r)])
    if "linear_proj" in name or "linear_fc2" in name:
        return _rows(full, tp, r, axis=1)
    return full


def _torch_chunk(x: np.ndarray[Any, Any], ways: int, i: int) -> np.ndarray[Any, Any]:
    size = -(-x.shape[0] // ways) if x.shape[0] else 0
    return x[min(i * size, x.shape[0]) : min((i + 1) * size, x.shape[0])]


def _flat_part(x: np.ndarray[Any, Any], ways: int, i: int) -> np.ndarray[Any, Any]:
    """DeepSpeed ZeRO-3: the flattened tensor padded to ``ways`` equal partitions."""
    flat = x.reshape(-1)
    size = -(-flat.size // ways) if flat.size else 0
    padded = np.concatenate([flat, np.zeros(size * ways - flat.size, dtype=x.dtype)])
    return padded[i * size : (i + 1) * size]


def is_expert(name: str) -> bool:
    return ".local_experts." in name


def local_names(mc: ModelConfig, cfg: ParallelConfig, rank: int) -> list[tuple[str, str]]:
    """(local name, global name) of the tensors ``rank`` holds, in model order."""
    _, dp, pp = _coords(cfg, rank)
    per_stage = mc.layers // cfg.pp
    first, last = pp == 0, pp == cfg.pp - 1
    ep_rank = dp % cfg.ep
    per_ep = mc.experts // cfg.ep
    out: list[tuple[str, str]] = []
    gt_names = list(ground_truth_shapes(mc))
    for name in gt_names:
        if name.startswith("embedding.") and first:
            out.append((name, name))
        elif name.startswith("decoder.layers."):
            layer = int(name.split(".")[2])
            if layer // per_stage != pp:
                continue
            local = name.replace(
                f"decoder.layers.{layer}.", f"decoder.layers.{layer - pp * per_stage}.", 1
            )
            if is_expert(name):
                e = int(name.split(".")[6])
                if e // per_ep != ep_rank:
                    continue
                local = local.replace(
                    f"local_experts.{e}.", f"local_experts.{e - ep_rank * per_ep}."
                )
            out.append((local, name))
        elif (name.startswith("decoder.final") or name == "output_layer.weight") and last:
            out.append((name, name))
    if mc.tied and last:
        out.append(("output_layer.weight", "embedding.word_embeddings.weight"))
    return out


def ground_truth_shapes(mc: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {n: a.shape for n, a in ground_truth(mc)["model"].items()}


def tp_local_state(
    gt: dict[str, np.ndarray[Any, Any]], mc: ModelConfig, cfg: ParallelConfig, rank: int
) -> dict[str, np.ndarray[Any, Any]]:
    """Each held tensor, tensor-parallel local (before ZeRO-3), by local name."""
    tp, _, _ = _coords(cfg, rank)
    out = {}
    for local, glob in local_names(mc, cfg, rank):
        name_for_layout = "output_layer.weight" if local == "output_layer.weight" else glob
        out[local] = _tp_local(name_for_layout, gt[glob], mc, cfg.tp, tp)
    return out


def shard(
    gt: dict[str, dict[str, np.ndarray[Any, Any]]], mc: ModelConfig, cfg: ParallelConfig, rank: int
) -> dict[str, Any]:
    """One rank's local state: model tensors, and optimizer state as the layout keeps it.

    ``model``: local name -> tensor (ZeRO-3: this rank's dim-0 chunk).
    ``optimizer``: zero 0: kind -> local name -> tensor; zero 3: the same, dim-0
    chunks; zero 1/2: kind -> group ("dense"/"expert") -> flat fp32 partition buffer.
    """
    _, dp, _ = _coords(cfg, rank)
    edp, ways_e = dp // cfg.ep, cfg.dp // cfg.ep
    model = tp_local_state(gt["model"], mc, cfg, rank)
    opt: dict[str, Any] = {kind: tp_local_state(gt[kind], mc, cfg, rank) for kind in OPT_KINDS}
    if mc.tied:
        for kind in OPT_KINDS:
            opt[kind].pop("output_layer.weight", None)  # tied: the optimizer steps it once
    if cfg.zero == 3:
        part = _flat_part if cfg.zero_style == "flat" else _torch_chunk

        def cut(state: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
            return {
                n: part(t, ways_e, edp) if is_expert(n) else part(t, cfg.dp, dp)
                for n, t in state.items()
            }

        model = cut(model)
        opt = {kind: cut(s) for kind, s in opt.items()}
    elif cfg.zero in (1, 2):
        flat: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
        for kind in OPT_KINDS:
            flat[kind] = {}
            for group, ways, index in (("dense", cfg.dp, dp), ("expert", ways_e, edp)):
                tensors = [t for n, t in opt[kind].items() if is_expert(n) == (group == "expert")]
                buffer = (
                    np.concatenate([t.reshape(-1) for t in tensors])
                    if tensors
                    else np.zeros(0, np.float32)
                )
                size = -(-buffer.size // ways) if buffer.size else 0
                buffer = np.concatenate([buffer, np.zeros(size * ways - buffer.size, np.float32)])
                flat[kind][group] = buffer[index * size : (index + 1) * size]
        opt = flat
    return {"model": model, "optimizer": opt}


def flat_group_order(mc: ModelConfig, cfg: ParallelConfig, rank: int, group: str) -> list[str]:
    """Local names of the parameters of a flat group, in buffer order."""
    names = [
        local
        for local, glob in local_names(mc, cfg, rank)
        if not (mc.tied and local == "output_layer.weight")
    ]
    return [n for n in names if is_expert(n) == (group == "expert")]
