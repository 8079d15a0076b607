"""The cells a shard's writer receives: joined into boxes, one per fragment part, not one
per refinement cell (their number would grow with the square of the partitions)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ucpformat.distributed.rank_description import describe
from ucpformat.distributed.save_plan import PlanOptions, TensorSpec, plan_from_descriptions
from ucpformat.layout.boxes import Box, box_size, intersect


def _flat_partitions(rows: int, cols: int, ranks: int) -> list[list[Box]]:
    """Each rank's boxes of a rows x cols tensor cut into ``ranks`` equal flat ranges
    (a partial first row, whole rows, a partial last row), as ZeRO partitions are."""
    total, out = rows * cols, []
    for r in range(ranks):
        lo, hi = total * r // ranks, total * (r + 1) // ranks
        boxes: list[Box] = []
        while lo < hi:
            row, col = divmod(lo, cols)
            if col or hi - lo < cols:  # a partial row
                end = min(cols, col + hi - lo)
                boxes.append(((row, row + 1), (col, end)))
                lo += end - col
            else:  # whole rows
                n = (hi - lo) // cols
                boxes.append(((row, row + n), (0, cols)))
                lo += n * cols
        out.append(boxes)
    return out


def test_flat_partitions_send_a_few_boxes_each_not_every_cell() -> None:
    rows, cols, ranks = 100, 60, 28  # 28 partitions, most cutting a row somewhere
    spec = TensorSpec("optimizer/w", (rows, cols), "float32")
    parts = _flat_partitions(rows, cols, ranks)
    descriptions = [describe([spec], [(spec.path, b) for b in boxes]) for boxes in parts]
    # one shard for the whole tensor: its writer receives every other partition
    plan = plan_from_descriptions(descriptions, PlanOptions(None, 4096, 1 << 20, 1 << 20))
    (obj,) = plan.tensors[spec.path].objects
    assert obj.remote and len(obj.remote) <= 3 * (ranks - 1)
    per_sender = Counter(sender for sender, _ in obj.remote)
    assert max(per_sender.values()) <= 3  # a partial row, whole rows, a partial row
    # the received boxes and the writer's own fragments cover the shard once, and each
    # box lies inside one fragment of its sender
    covered = np.zeros((rows, cols), dtype=int)
    for box in parts[obj.owner]:
        covered[tuple(slice(a, b) for a, b in box)] += 1
    for sender, box in obj.remote:
        covered[tuple(slice(a, b) for a, b in box)] += 1
        assert any(intersect(f, box) == box for f in parts[sender]), (sender, box)
    assert (covered == 1).all()
    assert sum(box_size(b) for _, b in obj.remote) == rows * cols - sum(
        box_size(b) for b in parts[obj.owner])
