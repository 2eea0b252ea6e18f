"""A GAN's loop as the DCGAN example writes it: a generator G and a discriminator D, an
AdamW each, both steps in one iteration, bfloat16 autocast on the CPU. Its data goes bad
at iteration NAN_AT (no nandoctor in it, no step number inside the models):

- `D`: a real sample that is all zeros: D's `Energy` takes the log of its mean square,
  -inf in D's forward;
- `G`: a noise row that is all zeros: G's `Radius` takes the square root of a sum of
  squares that is 0 there, finite in the forward, NaN in G's backward (its own step's).

`d-first` (the DCGAN order): D's step (on the reals and on G's fakes), then G's, which
reuses the fakes. `g-first`: G's step first, on fresh fakes, then D's.

python gan_nan.py [G|D] [NAN_AT] [STEPS] [d-first|g-first]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

LATENT, FEATURES, HIDDEN, BATCH = 4, 8, 16, 6


class Radius(nn.Module):
    """Appends each row's Euclidean length: sqrt(0) is finite, its gradient is not."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, h.float().pow(2).sum(-1, keepdim=True).sqrt().to(h.dtype)], -1)


class Energy(nn.Module):
    """Appends the log of each row's mean square: -inf for a row of zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.log(x.float().pow(2).mean(-1, keepdim=True)).to(x.dtype)], -1)


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Linear(LATENT, HIDDEN, bias=False)  # a row of zeros stays zeros
        self.radius = Radius()
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(HIDDEN + 1, FEATURES))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(self.radius(self.lift(z)))


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.energy = Energy()
        self.net = nn.Sequential(
            nn.Linear(FEATURES + 1, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.energy(x))


def data(which: str, nan_at: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each iteration's real samples and noise; the sample or the noise row that goes bad."""
    batches = []
    for i in range(steps):
        real = torch.randn(BATCH, FEATURES) * 0.5 + 1.0
        noise = torch.randn(BATCH, LATENT)
        if i == nan_at:
            (real if which == "D" else noise)[1].zero_()
        batches.append((real, noise))
    return batches


def main(which: str, nan_at: int, steps: int, order: str) -> None:
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    opt_g = torch.optim.AdamW(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.AdamW(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
    for real, noise in data(which, nan_at, steps):
        if order == "d-first":
            # D: maximise log D(x) + log(1 - D(G(z)))
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fake = G(noise)
                loss_d = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
            loss_d.backward()
            opt_d.step()
            # G: maximise log D(G(z)), on the same fakes
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_g = F.softplus(-D(fake)).mean()
            loss_g.backward()
            opt_g.step()
        else:
            opt_g.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fake = G(noise)
                loss_g = F.softplus(-D(fake)).mean()
            loss_g.backward()
            opt_g.step()
            opt_d.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_d = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
            loss_d.backward()
            opt_d.step()
    print("trained", steps, "iterations")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if len(args) > 0 else "G",
        int(args[1]) if len(args) > 1 else 15,
        int(args[2]) if len(args) > 2 else 20,
        args[3] if len(args) > 3 else "d-first",
    )
