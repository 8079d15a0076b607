"""One run of the Hugging Face Trainer tests: ``python -m tests.trainers.hf_worker
<scenario> <root>`` (run by tests/trainers/test_transformers.py).

A tiny model with dropout on shuffled data trains 12 steps (3 epochs of 4 batches,
AdamW, linear schedule) into ``<root>/full``, saving every 3 steps (mid-epoch) with
``save_total_limit=2``; ``resume`` resumes from ``full/checkpoint-9`` into
``<root>/resume``. Losses and the final
parameters go to ``<root>/<scenario>.json``.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

from transformers import TrainingArguments  # noqa: E402

from tests.trainers.launch import finish  # noqa: E402
from ucpformat.trainers.transformers import UCPTrainer  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, width)
        self.drop = torch.nn.Dropout(0.25)
        self.down = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.down(self.drop(torch.relu(self.up(x))))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(8, generator=g), "labels": torch.randn(4, generator=g)}
            for _ in range(16)]


class Recording(UCPTrainer):
    losses: list[float]

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        value = loss[0] if isinstance(loss, tuple) else loss
        self.losses.append(float(value.detach()))
        return loss


def make(out: Path, width: int = 16) -> Recording:
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=3,
        learning_rate=0.01, save_strategy="steps", save_steps=3, save_total_limit=2,
        logging_steps=1, report_to=[], use_cpu=True, seed=7, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = Recording(model=Tiny(width), args=args, train_dataset=dataset())
    trainer.losses = []
    return trainer


def main() -> None:
    scenario, root = sys.argv[1], Path(sys.argv[2])
    code = 0
    try:
        trainer = make(root / scenario)
        if scenario == "full":
            trainer.train()
        else:
            trainer.train(resume_from_checkpoint=str(root / "full" / "checkpoint-9"))
        (root / f"{scenario}.json").write_text(json.dumps({
            "losses": trainer.losses, "step": trainer.state.global_step,
            "params": {k: v.tolist() for k, v in trainer.model.state_dict().items()}}))
    except BaseException:
        traceback.print_exc()
        code = 1
    finish(code)


if __name__ == "__main__":
    main()
