"""A GAN trained as the DCGAN example trains it: the discriminator's step on real and
fake samples, then the generator's, an optimizer each.

    python gan.py --nan-at 9    (a NaN among the real samples of iteration 9)
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None)
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
NZ = 4

netG = nn.Sequential(nn.Linear(NZ, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())
netD = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
fixed_noise = torch.randn(4, NZ)
for i in range(16):
    real = torch.randn(12, 8) * 0.5 + 1.0
    if i == args.nan_at:
        real[3, 2] = float("nan")
    netD.zero_grad()
    errD_real = criterion(netD(real), torch.ones(12, 1))
    errD_real.backward()
    fake = netG(torch.randn(12, NZ))
    errD_fake = criterion(netD(fake.detach()), torch.zeros(12, 1))
    errD_fake.backward()
    optimizerD.step()
    netG.zero_grad()
    errG = criterion(netD(fake), torch.ones(12, 1))
    errG.backward()
    optimizerG.step()
    print(f"step {i} loss_D {(errD_real + errD_fake).item():.6g} loss_G {errG.item():.6g}")
with torch.no_grad():
    print("samples", netG(fixed_noise).sum().item())
torch.save({"G": netG.state_dict(), "D": netD.state_dict()}, "gan.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
