"""configs/seed-fp16-nan.yaml as the plain training script a user would write: no
nandoctor in it (the model and data builders are the config's own). The same seed,
settings and order as `diagnose` builds and steps them, so `nandoctor watch` must find
the same step and phase. tests/cli/test_watch.py checks the constants below against the
config, so the two cannot drift apart.

    float16 autocast + GradScaler, SGD with momentum, no clipping, and the
    hand-written loss -(y * log(softmax(logits))).sum(-1).mean()
"""

import random
import sys

import numpy
import torch

from nandoctor.examples.seed import build_data, build_model

SEED = 0
MODEL_ARGS = {"depth": 4}
DATA_ARGS = {"batches": 12, "batch_size": 64}
LR, MOMENTUM = 0.3, 0.9
INIT_SCALE = 65536.0
STEPS = 400


def main(steps: int = STEPS) -> int:
    random.seed(SEED)
    torch.manual_seed(SEED)
    numpy.random.seed(SEED)
    model = build_model(**MODEL_ARGS)
    data = build_data(**DATA_ARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for step in range(steps):
        x, y = data[step % len(data)]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    print("trained", steps, "steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:2])))  # NB: fewer steps, to stop before it fails
