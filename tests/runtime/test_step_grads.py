"""Which gradients a step made: those it began with and left alone are the last step's."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from nandoctor.runtime.step_grads import StepGradients


def _backward(model: nn.Module) -> None:
    model(torch.ones(2, 3)).sum().backward()


def test_a_gradient_the_step_began_with_and_left_alone_is_not_the_steps():
    """A GAN's generator, its gradients still the last step's when the discriminator's
    backward ends: they are not this step's; the discriminator's, made anew, are."""
    G, D = nn.Linear(3, 3), nn.Linear(3, 3)
    _backward(G)
    step = StepGradients()
    step.begin([*G.parameters(), *D.parameters()])
    _backward(D)
    assert step.of([*G.parameters(), *D.parameters()]) == [p.grad for p in D.parameters()]
    assert step.made(G.weight) is None and step.made(D.weight) is D.weight.grad


def test_a_gradient_written_in_place_or_replaced_is_the_steps():
    """Accumulated into (backward again), zeroed in place, or set to None and made anew:
    each is the step's own."""
    model = nn.Linear(3, 3)
    _backward(model)
    for change in (
        lambda: _backward(model),
        lambda: model.zero_grad(set_to_none=False),
        lambda: (model.zero_grad(set_to_none=True), _backward(model)),
    ):
        step = StepGradients()
        step.begin(model.parameters())
        change()
        assert step.of(model.parameters()) == [model.weight.grad, model.bias.grad]


def test_it_keeps_no_gradient_alive():
    """The step's start is remembered by weak references: a gradient the loop drops
    (zero_grad's default) is freed, its memory not held for the step."""
    model = nn.Linear(3, 3)
    _backward(model)
    old = weakref.ref(model.weight.grad)
    step = StepGradients()
    step.begin(model.parameters())
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert old() is None
    _backward(model)
    assert step.made(model.weight) is model.weight.grad
