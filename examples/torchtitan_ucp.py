"""torchtitan's llama3 debug model, checkpointing to UCP: a config_registry module.

On a machine where torchtitan's trainer runs (CUDA, torchtitan 0.3 with its datasets and
tokenizer assets), from the repository root::

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module examples.torchtitan_ucp --config llama3_debugmodel_ucp

Every ``checkpoint.interval`` steps the manager writes ``<dump_folder>/checkpoint/step-N``
as one UCP checkpoint (asynchronously), and a rerun of the same command resumes from the
newest one it finds; ``ucp validate --deep`` checks any of them, and
``ucpformat.torch.load`` reads one into a single process. What the test suite runs of it
on CPU: tests/trainers/test_torchtitan.py (torchtitan's trainer needs triton).
"""

from __future__ import annotations

from typing import Any


def llama3_debugmodel_ucp() -> Any:
    """``llama3_debugmodel`` with its checkpoint manager switched to UCP."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from ucpformat.trainers.torchtitan import UCPCheckpointManager

    config = llama3_debugmodel()
    config.checkpoint = UCPCheckpointManager.Config(
        enable=True, interval=5, keep_latest_k=2, async_mode="async",
        last_save_model_only=False)
    return config
