"""A model whose forward ends in a softmax, then a log of its output in the training loop."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(784, 10)
        self.head = nn.Sequential(nn.Linear(10, 10), nn.Softmax(dim=1))

    def forward(self, x):
        return F.softmax(self.fc(x), dim=1)

    def head_log_probs(self, x):
        return torch.log(self.head(x))  # expect: log-of-softmax


class Logits(nn.Module):
    def forward(self, x):
        return x * 2


def predict(model, x):
    return torch.softmax(model(x), -1)


model = Net()
plain = Logits()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for data, target in loader:
    output = model(data)
    loss = F.nll_loss(torch.log(output), target)  # expect: log-of-softmax
    confidence = torch.log(predict(model, data)).max()  # expect: log-of-softmax
    fine = F.nll_loss(F.log_softmax(plain(data), dim=1), target)
    gate = torch.log(plain(data).sigmoid())  # expect: log-of-softmax
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
