"""Clipping with a GradScaler: before unscale_ (flagged) and after it (fine)."""

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_


def clips_scaled_gradients(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: clip-before-unscale
    scaler.step(opt)
    scaler.update()


def clips_values_with_an_alias(model, opt, grad_scaler, loss):
    grad_scaler.scale(loss).backward()
    clip_grad_value_(model.parameters(), 0.5)  # expect: clip-before-unscale
    grad_scaler.step(opt)


def unscales_too_late(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: clip-before-unscale
    scaler.unscale_(opt)
    scaler.step(opt)


def clip_helper(model):
    clip_grad_norm_(model.parameters(), max_norm=1.0)


def calls_the_helper_too_early(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    clip_helper(model)  # expect: clip-before-unscale
    scaler.step(opt)


def calls_the_helper_after_unscale(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    clip_helper(model)
    scaler.step(opt)


def unscales_first(model, opt, scaler, loss, step, accumulate):
    scaler.scale(loss).backward()
    if (step + 1) % accumulate == 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()


def amp_or_not(model, opt, scaler, loss, use_amp):
    if use_amp:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def amp_branch_without_clip(model, opt, scaler, loss):
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def no_scaler_here(model, opt, loss):
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def accelerate(accelerator, model, opt, loss):
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


class Trainer:
    def __init__(self, model):
        self.model = model
        self.scaler = torch.cuda.amp.GradScaler()

    def step(self, loss, opt):
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(opt)
        self.scaler.update()

    def step_badly(self, loss, opt):
        self.scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # expect: clip-before-unscale
        self.scaler.step(opt)


class SplitTrainer:
    """Backward in one method, the optimizer step in another."""

    def backward(self, loss):
        self.grad_scaler.scale(loss).backward()

    def step(self, model, opt):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: clip-before-unscale
        self.grad_scaler.step(opt)
        self.grad_scaler.update()

    def step_right(self, model, opt):
        self.grad_scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        self.grad_scaler.step(opt)
