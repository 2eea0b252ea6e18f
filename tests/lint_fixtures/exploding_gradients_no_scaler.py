"""No GradScaler (bfloat16, or float32): an unclipped loop is not this check's business."""

import torch


def train(model, opt, loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
