"""Read amplification of resharded loads: bytes read / bytes needed, per target layout.

A Llama-style model is saved from one layout with the distributed writer (ranks as
threads) and loaded into others; every loading rank reads only the regions its local
tensors need. Amplification comes from inner chunks that straddle a region's edge.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ucpformat
from ucpformat.distributed import save_fragments
from ucpformat.distributed.comm import ThreadGroup, run_threads
from ucpformat.distributed.framework import ModelLayout
from ucpformat.layout.rank_slices import ParallelConfig
from ucpformat.layout.rules import RuleSet


def llama_state(
    hidden: int, ffn: int, layers: int, vocab: int, heads: int, kv_heads: int
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    hd = hidden // heads
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * hd, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * hd, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * hd, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * hd),
            f"{p}.mlp.gate_proj.weight": (ffn, hidden),
            f"{p}.mlp.up_proj.weight": (ffn, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, ffn),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    return {
        n: rng.standard_normal(s, dtype=np.float32).astype(ml_dtypes.bfloat16)
        for n, s in shapes.items()
    }


def run(quick: bool = False) -> list[dict[str, Any]]:
    dims = (
        dict(hidden=512, ffn=1536, layers=2, vocab=8000, heads=8, kv_heads=4)
        if quick
        else dict(hidden=1024, ffn=2816, layers=4, vocab=32000, heads=16, kv_heads=4)
    )
    gt = llama_state(**dims)
    rules = RuleSet.load("llama")
    params = {"vocab_size": dims["vocab"], "tie_word_embeddings": False}
    shapes = {n: a.shape for n, a in gt.items()}
    source = ParallelConfig(tp=4, num_layers=dims["layers"])
    tmp = Path(tempfile.mkdtemp(prefix="ucp-bench-reshard-"))
    rows: list[dict[str, Any]] = []
    try:
        path = tmp / "ckpt"
        src = ModelLayout(rules, params, source, shapes)

        def save_rank_impl(comm: ThreadGroup) -> Any:
            local = {}
            coords = source.coords(comm.rank)
            for name, full in gt.items():
                resolved = src.resolve(name)
                assert resolved is not None
                lmap = src.tensor_map(
                    full.shape, resolved.layout, resolved.conventions, coords, tensor=name
                )
                assert lmap is not None
                buf = np.zeros(lmap.local_shape, dtype=full.dtype)
                for p in lmap.pieces:
                    buf[tuple(slice(a, b) for a, b in p.local)] = full[
                        tuple(slice(a, b) for a, b in p.glob)
                    ]
                local[name] = buf
            specs, frags, _ = src.fragments(comm.rank, local)
            return save_fragments(path, comm, specs=specs, fragments=frags)

        t0 = time.perf_counter()
        run_threads(source.world, save_rank_impl)
        save_s = time.perf_counter() - t0
        total = sum(a.nbytes for a in gt.values())
        for label, target in [
            ("TP4 -> TP1", ParallelConfig(tp=1, num_layers=dims["layers"])),
            ("TP4 -> TP2", ParallelConfig(tp=2, num_layers=dims["layers"])),
            ("TP4 -> TP8", ParallelConfig(tp=8, num_layers=dims["layers"])),
            ("TP4 -> TP2 x PP2", ParallelConfig(tp=2, pp=2, num_layers=dims["layers"])),
            (
                "TP4 -> FSDP4 (ZeRO-3 dim 0)",
                ParallelConfig(dp=4, zero=3, num_layers=dims["layers"]),
            ),
        ]:
            ml = ModelLayout(rules, params, target, shapes)
            needed = read = 0
            t0 = time.perf_counter()
            for rank in range(target.world):
                ckpt = ucpformat.open(path)
                state = ml.local_state(ckpt, rank)
                needed += sum(_real_bytes(ml, rank, n, a) for n, a in state.items())
                read += ckpt.stats.bytes_read
            rows.append(
                {
                    "load": label,
                    "ranks": target.world,
                    "bytes needed": needed,
                    "bytes read": read,
                    "amplification": round(read / needed, 4) if needed else math.nan,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            )
        rows.insert(
            0,
            {
                "load": f"save TP4 ({total / 2**20:.0f} MiB bf16)",
                "ranks": 4,
                "bytes needed": total,
                "bytes read": 0,
                "amplification": math.nan,
                "seconds": round(save_s, 3),
            },
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _real_bytes(ml: ModelLayout, rank: int, local_name: str, arr: np.ndarray[Any, Any]) -> int:
    """Bytes of consolidated data in a local tensor (padding excluded)."""
    coords = ml.coords(rank)
    name = ml.rules.global_name(local_name, ml.params, ml.cfg, coords)
    resolved = ml.resolve(name)
    assert resolved is not None
    lmap = ml.tensor_map(
        ml.shapes[name], resolved.layout, resolved.conventions, coords, tensor=name
    )
    assert lmap is not None
    return lmap.covered * arr.itemsize


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
