"""Write the example checkpoints of spec/ucp-1.0.md and print the examples it shows.

The directory tree and every ```json schema=...``` block of the spec were made with this
script from checkpoints written by the reference library; tests/test_spec.py validates
each block against its schema. Run it from the repository root:

    python spec/tools/make_examples.py /tmp/ucp-examples
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ucpformat


def compact(value: Any, indent: int = 0, width: int = 88) -> str:
    """JSON with two-space indentation; containers that fit on one line stay on one."""
    flat = json.dumps(value, ensure_ascii=False)
    if len(flat) + indent <= width or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {compact(v, indent + 2, width)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + compact(v, indent + 2, width) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def tree(root: Path) -> str:
    lines = [root.name + "/"]

    def walk(directory: Path, prefix: str) -> None:
        entries = sorted(directory.iterdir(), key=lambda p: p.name)
        for i, entry in enumerate(entries):
            last = i == len(entries) - 1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{entry.name}")
            if entry.is_dir():
                walk(entry, prefix + ("    " if last else "│   "))

    walk(root, "")
    return "\n".join(lines)


def block(kind: str, doc: Any) -> str:
    return f"```json schema={kind}\n{compact(doc)}\n```"


def main(out: Path) -> None:
    rng = np.random.default_rng(20261121)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    state = {
        "model": {
            "fc.weight": w,
            "fc.bias": np.zeros(32, np.float32),
            "embed.weight": rng.standard_normal((10, 8)).astype(ml_dtypes.bfloat16),
        },
        "optimizer": {
            "type": "torch.optim.AdamW",
            "param_groups": [
                {"params": ["fc.weight", "fc.bias"], "lr": 0.001, "betas": [0.9, 0.999],
                 "weight_decay": 0.01},
                {"params": ["embed.weight"], "lr": 0.001, "betas": [0.9, 0.999],
                 "weight_decay": 0.0},
            ],
            "state": {
                "fc.weight": {
                    "exp_avg": np.zeros_like(w),
                    "exp_avg_sq": np.zeros_like(w),
                    "step": np.array(0.0, np.float32),
                },
            },
        },
        "training": {
            "step": 0,
            "scheduler": {"last_epoch": 0},
            "best_loss": float("inf"),
            "rng": {"torch_cpu": np.arange(16, dtype=np.uint8)},
        },
    }
    roles = {"model": "parameter", "optimizer": "optimizer_state", "training": "training_state"}

    def attrs(path: str, arr: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"ucp": {"role": roles[path.split("/")[0]]}}

    full = out / "ckpt"
    ucpformat.save(full, state, chunk_bytes=2048, shard_bytes=4096, array_attributes=attrs,
                   overwrite=True)
    assert ucpformat.validate(full, deep=True).valid
    print(tree(full), end="\n\n")
    for node in ("model/fc.weight", "optimizer", "training"):
        doc = json.loads((full / node / "zarr.json").read_text())
        print(block("array" if doc["node_type"] == "array" else "group", doc), end="\n\n")
    opt = json.loads((full / "optimizer" / "zarr.json").read_text())
    print(block("optimizer", opt["attributes"]["ucp"]["values"]), end="\n\n")

    f8 = out / "f8"
    ucpformat.save(
        f8,
        {"model": {"proj.weight": np.ones((4, 8), np.float32).astype(ml_dtypes.float8_e4m3fn)}},
        compression="zstd",
        array_attributes=lambda p, a: {"ucp": {"role": "parameter"}},
        overwrite=True,
    )
    print(block("array", json.loads((f8 / "model" / "proj.weight" / "zarr.json").read_text())),
          end="\n\n")

    tiny = out / "tiny"
    ucpformat.save(tiny, {"model": {"fc.bias": np.zeros(4, np.float32)},
                          "training": {"step": 0}}, overwrite=True)
    root = json.loads((tiny / "zarr.json").read_text())
    print(block("root", root), end="\n\n")
    print(block("manifest", json.loads((tiny / "manifest.ucp.json").read_text())))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "ucp-examples"))
