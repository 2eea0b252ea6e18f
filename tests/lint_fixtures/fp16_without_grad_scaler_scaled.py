"""A trainer whose float16 autocast is scaled: a GradScaler held as an attribute, built
elsewhere and passed in. Nothing to report, though the file also backpropagates plainly."""

import torch
import torch.nn.functional as F


class Trainer:
    def __init__(self, model, opt, scaler):
        self.model = model
        self.opt = opt
        self.scaler = scaler

    def step(self, x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)

    def finetune_head(self, x, y):
        loss = F.cross_entropy(self.model(x), y)  # float32: no autocast here
        loss.backward()
        self.opt.step()
