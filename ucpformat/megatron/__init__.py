"""Megatron-core saves straight into UCP, and loads it at any TP/PP/EP degree.

megatron-core's ``dist_checkpointing`` hands every rank's ``sharded_state_dict`` to a
pluggable strategy. This package provides one for saving and one for loading, under the
backend name ``"ucp"``::

    import ucpformat.megatron as ucp_megatron
    from megatron.core import dist_checkpointing

    params = ucp_megatron.rule_params(model.config, vocab_size=tokenizer.vocab_size)
    ucp_megatron.register(params)              # once per process, before save or load
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir,
                            sharded_strategy=("ucp", 1))
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)  # picks "ucp"

megatron-core is optional and imported only when a strategy is built (the strategy
classes live in :mod:`ucpformat.megatron.strategies`). See docs/megatron.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ucpformat.layout.rules import RuleSet

if TYPE_CHECKING:
    from ucpformat.megatron.strategies import UCPLoadStrategy, UCPSaveStrategy

BACKEND = "ucp"
VERSION = 1


def rule_params(
    config: Any,
    *,
    vocab_size: int,
    tie_word_embeddings: bool,
    make_vocab_size_divisible_by: int | None = None,
) -> dict[str, Any]:
    """The ``megatron-gpt`` rule parameters of a model, from its ``TransformerConfig``.

    ``vocab_size`` is the real (unpadded) vocabulary size, which the model does not know
    (GPTModel is built with the padded one); ``tie_word_embeddings`` is the model's
    ``share_embeddings_and_output_weights``; ``make_vocab_size_divisible_by`` (optional)
    is recorded as the padding multiple of the saving run.
    """
    heads = int(config.num_attention_heads)
    groups = config.num_query_groups or heads
    kv = config.kv_channels or config.hidden_size // heads
    out: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_query_groups": int(groups),
        "kv_channels": int(kv),
        "ffn_hidden_size": int(config.ffn_hidden_size),
        "gated_linear_unit": bool(config.gated_linear_unit),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "vocab_size": int(vocab_size),
    }
    if getattr(config, "num_moe_experts", None):
        out["num_experts"] = int(config.num_moe_experts)
        out["moe_ffn_hidden_size"] = int(config.moe_ffn_hidden_size or config.ffn_hidden_size)
    if make_vocab_size_divisible_by is not None:
        out["vocab_multiple"] = int(make_vocab_size_divisible_by)
    return out


def register(
    rule_params: Mapping[str, Any] | None = None,
    *,
    rules: str | os.PathLike[str] | RuleSet = "megatron-gpt",
    backend: str = BACKEND,
    version: int = VERSION,
    allow_opaque: bool = False,
    unpickle_opaque: bool = False,
    **save_options: Any,
) -> None:
    """Register the strategies as megatron-core's defaults for ``(backend, version)``, so
    that ``sharded_strategy=("ucp", 1)`` saves with them and ``dist_checkpointing.load``
    finds them from the checkpoint's ``metadata.json``. Without ``rule_params`` only the
    load strategy is registered (loading needs no model description). ``save_options``
    go to :class:`~ucpformat.megatron.strategies.UCPSaveStrategy`.

    Two opt-ins, apart: ``allow_opaque`` lets saves store ShardedObjects that are not JSON
    values and tensors as ``torch.save`` bytes; ``unpickle_opaque`` lets loads unpickle
    such bytes (which runs code from the checkpoint). A process that opted in to store
    them does not thereby unpickle what it loads."""
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        register_default_strategy,
    )

    from ucpformat.megatron.strategies import UCPLoadStrategy, UCPSaveStrategy

    register_default_strategy(
        StrategyAction.LOAD_SHARDED, backend, version,
        UCPLoadStrategy(backend=backend, version=version, allow_opaque=unpickle_opaque),
    )
    if rule_params is not None:
        register_default_strategy(
            StrategyAction.SAVE_SHARDED, backend, version,
            UCPSaveStrategy(rule_params, rules=rules, backend=backend, version=version,
                            allow_opaque=allow_opaque, **save_options),
        )


def __getattr__(name: str) -> Any:
    if name in ("UCPSaveStrategy", "UCPLoadStrategy"):
        from ucpformat.megatron import strategies

        return getattr(strategies, name)
    from ucpformat.compat import moved_attribute  # store: moved in 0.2

    return moved_attribute(__name__, name)


__all__ = ["BACKEND", "VERSION", "UCPLoadStrategy", "UCPSaveStrategy", "register",
           "rule_params"]
