"""DeepSpeed's universal_checkpoint_info categories read as layout semantics
(ucpformat.layout.universal_info; the importer and live AutoTP engines share it)."""

from __future__ import annotations

import pytest

from ucpformat.errors import UnsupportedFeatureError
from ucpformat.layout.universal_info import original_vocab_size, tensor_layout

#: what DeepSpeed 0.19.8's AutoTP writes for a small Llama (names shortened)
INFO = {
    "parameter_with_row_parallelism_patterns": [r"^o_proj\.weight$"],
    "tp_replicated_parameter_patterns": [r"^norm\.weight$"],
    "vocabulary_parameter_patterns": [r"^lm_head\.weight$"],
    "parameter_with_sub_params": [{"patterns": [r"^qkv\.weight$"], "shape": [[16, 8, 8], 32],
                                   "partition_dim": 0}],
    "autotp_unsupported_parameter_patterns": {r"^odd\.weight$": "a fused layout it cannot "
                                                               "describe"},
    "original_vocab_size": 96,
}


def test_categories() -> None:
    def doc(name: str, shape: tuple[int, ...]) -> dict[str, object]:
        return tensor_layout(INFO, name, shape, 2)[0].to_json()

    assert doc("o_proj.weight", (32, 16)) == {"tp": {"dim": 1}}
    assert doc("q_proj.weight", (16, 32)) == {"tp": {"dim": 0}}
    assert doc("norm.weight", (32,)) == {}
    assert doc("lm_head.weight", (48, 32)) == {"tp": {"dim": 0}, "vocab": {"dim": 0}}
    parts = tensor_layout(INFO, "qkv.weight", (16, 32), 2)[0].parts
    assert [(p.name, p.size) for p in parts] == [("0", 16), ("1", 8), ("2", 8)]
    assert tensor_layout(INFO, "o_proj.weight", (32, 32), 1)[0].to_json() == {}
    assert original_vocab_size(INFO) == 96
    assert original_vocab_size({}) is None


def test_what_deepspeed_cannot_describe_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedFeatureError, match=r"odd\.weight"):
        tensor_layout(INFO, "odd.weight", (8, 8), 2)
    with pytest.raises(UnsupportedFeatureError, match="averaged"):
        tensor_layout({"parameter_to_average_patterns": [r"^a$"]}, "a", (4,), 2)
