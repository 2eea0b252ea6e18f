"""GradScaler loops and no clipping anywhere in the file: one finding, at the first step."""

import torch

model = torch.nn.Linear(4, 2).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
grad_scaler = torch.amp.GradScaler("cuda")


def train_one_epoch(loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        grad_scaler.scale(loss).backward()
        grad_scaler.step(opt)  # expect: exploding-gradients
        grad_scaler.update()


def scaled_backward_only(loss):
    scaler = torch.cuda.amp.GradScaler()
    scaler.scale(loss).backward()
