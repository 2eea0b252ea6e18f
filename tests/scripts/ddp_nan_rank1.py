"""A DDP loop on 2 ranks (gloo) whose rank 1 batch at step NAN_AT holds a NaN (WHERE
`input`), or whose rank 1 backward alone makes one there (`backward`: a finite loss
plus 0 x sqrt(0), whose derivative is inf); run it under torchrun (no nandoctor in it).

torchrun --standalone --nproc-per-node 2 ddp_nan_rank1.py [NAN_AT] [STEPS] [WHERE]
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main(nan_at: int, steps: int, where: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if step == nan_at and rank == 1 and where == "input":
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if step == nan_at and rank == 1 and where == "backward":
            loss = loss + 0.0 * torch.sqrt((logits - logits.detach()).pow(2).sum())
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    nan_at, steps, where = [*sys.argv[1:4], *("4", "8", "input")[len(sys.argv) - 1 :]]
    main(int(nan_at), int(steps), where)
