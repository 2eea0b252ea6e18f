"""A word language model trained as pytorch/examples' word_language_model/main.py trains
it: an LSTM (or a Transformer) over batchified token columns, truncated backpropagation
with the hidden state detached, gradient clipping, and a hand-written SGD update (no
optimizer) unless --use-optimizer; evaluation under no_grad after each epoch, the whole
model saved with `torch.save(model, f)` when it is the best so far, loaded back at the end.

    python lm.py --model LSTM --nan-at 7
    python lm.py --model Transformer --use-optimizer --lr 20
"""

import argparse
import math
import random

import numpy as np
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="LSTM")
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--bptt", type=int, default=8)
parser.add_argument("--save", default="model.pt")
parser.add_argument("--use-optimizer", action="store_true")
parser.add_argument("--nan-at", type=int, default=None, help="a NaN embedding at this batch")
args = parser.parse_args()

torch.manual_seed(1111)
random.seed(1111)
np.random.seed(1111)
NTOKENS, EMSIZE, NHID = 50, 16, 16


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(NTOKENS, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, 1)
        self.decoder = nn.Linear(NHID, NTOKENS)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        return torch.log_softmax(self.decoder(self.drop(output)), dim=-1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, NHID), weight.new_zeros(1, bsz, NHID))


class TransformerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(NTOKENS, EMSIZE)
        layer = nn.TransformerEncoderLayer(EMSIZE, 2, NHID, 0.2)
        self.transformer = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.decoder = nn.Linear(EMSIZE, NTOKENS)

    def forward(self, src):
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        output = self.transformer(self.encoder(src) * math.sqrt(EMSIZE), mask)
        return torch.log_softmax(self.decoder(output), dim=-1)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


g = torch.Generator().manual_seed(0)
train_data = batchify(torch.randint(0, NTOKENS, (1000,), generator=g), 10)
val_data = batchify(torch.randint(0, NTOKENS, (200,), generator=g), 5)
transformer = args.model == "Transformer"
model = TransformerModel() if transformer else RNNModel()
criterion = nn.NLLLoss()
if args.use_optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)


def repackage_hidden(h):
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].view(-1)


def evaluate(data_source):
    model.eval()
    total_loss = 0.0
    hidden = None if transformer else model.init_hidden(5)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            if transformer:
                output = model(data)
            else:
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output.view(-1, NTOKENS), targets).item()
    return total_loss / (len(data_source) - 1)


step = 0


def train():
    global step
    model.train()
    hidden = None if transformer else model.init_hidden(10)
    for i in range(0, train_data.size(0) - 1, args.bptt):
        data, targets = get_batch(train_data, i)
        if args.use_optimizer:
            optimizer.zero_grad()
        else:
            model.zero_grad()
        if step == args.nan_at:
            with torch.no_grad():
                model.encoder.weight[data[0, 0]] = float("nan")
        if transformer:
            output = model(data)
        else:
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
        loss = criterion(output.view(-1, NTOKENS), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if args.use_optimizer:
            optimizer.step()
        else:
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
        print(f"step {step} loss {loss.item():.6g}")
        step += 1


lr = args.lr
best_val_loss = None
for epoch in range(1, args.epochs + 1):
    train()
    val_loss = evaluate(val_data)
    print(f"| end of epoch {epoch} | valid loss {val_loss:.6g}")
    if not best_val_loss or val_loss < best_val_loss:
        with open(args.save, "wb") as f:
            torch.save(model, f)
        best_val_loss = val_loss
    else:
        lr /= 4.0

with open(args.save, "rb") as f:
    model = torch.load(f, weights_only=False)
if not transformer:
    model.rnn.flatten_parameters()
print(f"| end of training | valid loss {evaluate(val_data):.6g}")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
