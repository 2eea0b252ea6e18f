"""GradScaler loops whose gradients are clipped somewhere: nothing to report."""

import torch


def clip(model, max_norm):
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def train_step(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    clip(model, 1.0)
    scaler.step(opt)
    scaler.update()


def timm_style(loss_scaler, loss, opt, model):
    loss_scaler(loss, opt, clip_grad=1.0, parameters=model.parameters())
