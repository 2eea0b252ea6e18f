"""float16 autocast and a plain `loss.backward()`, no GradScaler in the file: each training
autocast is flagged; evaluation, bfloat16 and the CPU's autocast are not."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.cuda.amp import autocast

HALF = torch.half
device_type = "cuda" if torch.cuda.is_available() else "cpu"
ctx = torch.amp.autocast(device_type=device_type, dtype=HALF)  # expect: fp16-without-grad-scaler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    @torch.autocast("cuda")  # expect: fp16-without-grad-scaler
    def forward(self, x):
        return self.fc(x)


def train_epoch(model, opt, loader):
    model.train()
    for x, y in loader:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):  # expect: fp16-without-grad-scaler
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return validate(model, loader)


def train_gan(gen, disc, g_opt, d_opt, z, real):
    with autocast():  # expect: fp16-without-grad-scaler
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
    d_loss.backward()
    d_opt.step()
    with autocast(dtype=torch.bfloat16):
        g_loss = -disc(gen(z)).mean()
    g_loss.backward()
    g_opt.step()


def train_with_ctx(model, opt, loader):
    for x, y in loader:
        with ctx:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()


def train_on_cpu(model, opt, x, y):
    with torch.autocast("cpu"):  # bfloat16: CPU autocast's default
        loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def train_without_amp(model, opt, x, y):
    with torch.autocast("cuda", dtype=torch.float16, enabled=False):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()


@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    with torch.autocast("cuda", dtype=torch.float16):
        return sum(F.cross_entropy(model(x), y) for x, y in loader)


def validate(model, loader):
    losses = []
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):  # never backpropagated
            losses.append(F.cross_entropy(model(x), y).item())
    return losses


def predict(model, x):
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        return model(x).argmax(-1)
