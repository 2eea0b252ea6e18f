"""A plain float32 loop that calls its model with keywords, `model(**batch)`, and lets
the model compute its own loss, as transformers' models do; the float labels of step
NAN_AT hold a NaN (no nandoctor in it).

python keyword_labels.py [NAN_AT] [STEPS]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict:
        pred = self.net(features).squeeze(-1)
        return {"loss": F.mse_loss(pred, labels), "logits": pred}


def main(nan_at: int, steps: int) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batch = {"features": torch.randn(8, 8), "labels": torch.randn(8)}
        if step == nan_at:
            batch["labels"][3] = float("nan")
        optimizer.zero_grad()
        model(**batch)["loss"].backward()
        optimizer.step()
    print("trained", steps, "steps")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 6)
