"""The forecast's signals on the device (runtime/precursors.py, runtime/softmax_watch.py):
what each one measures, where it names it, how it rides on the sentinel's read, and that
it leaves no trace."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nandoctor
from nandoctor.report.signals import (
    ACTIVATION_PEAK,
    ATTENTION_LOGIT,
    SOFTMAX_SPREAD,
    UPDATE_RATIO,
)
from nandoctor.runtime import softmax_watch
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.precursors import Precursors, forecasting
from nandoctor.runtime.probe import Phase, Probes, StepContext
from nandoctor.runtime.sentinel import Sentinel


class Attention(nn.Module):
    """Eager attention (a softmax over (batch, heads, queries, keys)) and SDPA, causal."""

    def __init__(self, dim: int = 8, sdpa: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.sdpa = sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # one head
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return (F.softmax(scores.masked_fill(causal, -torch.inf), -1) @ v).squeeze(1)


class Net(nn.Module):
    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.attn = Attention(sdpa=sdpa)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.attn(x))).squeeze(-1)


def step(
    model: nn.Module, optimizer, loss_fn, probe, x: torch.Tensor, number: int = 0
) -> StepContext:
    """One step announced as the hooks announce it: LOSS (the forward inside), BACKWARD,
    OPTIMIZER."""
    ctx = StepContext(RUNS[id(probe)], number, x)
    probe.step_started(ctx)
    probe.phase_started(ctx, Phase.LOSS)
    optimizer.zero_grad()
    loss = loss_fn(model(x))
    ctx.loss = loss
    probe.phase_ended(ctx, Phase.LOSS)
    loss.backward()
    probe.phase_started(ctx, Phase.OPTIMIZER)
    optimizer.step()
    probe.phase_ended(ctx, Phase.OPTIMIZER)
    return ctx


RUNS: dict[int, HookedRun] = {}


def probe_for(model: nn.Module, optimizer) -> Precursors:
    run = HookedRun(model=model, given_optimizer=optimizer, device=torch.device("cpu"))
    run.note_optimizer(optimizer)
    probe = Precursors(run)
    RUNS[id(probe)] = run
    return probe


def signals(probe: Precursors) -> dict:
    taken = probe.take()
    assert taken is not None
    layout, values = taken
    return {(s.metric, s.module, s.op): (s, v) for s, v in layout.read(values.tolist())}


def test_a_log_of_a_softmax_in_the_loss_is_measured_outside_the_model_and_marked_logged():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])

    def loss_fn(logits):
        return -torch.log(torch.softmax(logits, -1))[:, 0].mean()

    logits = model(x).detach()
    with probe_for(model, optimizer) as probe:
        step(model, optimizer, loss_fn, probe, x)
        found = signals(probe)
    site, spread = found[(SOFTMAX_SPREAD, None, softmax_watch.SOFTMAX)]
    assert site.logged and site.dtype == "float32" and site.limit == pytest.approx(103.97, 1e-3)
    assert spread == pytest.approx((logits.max() - logits.min()).item())


def test_in_float16_the_limit_is_float16_s_underflow_and_a_softmax_not_logged_is_not_marked():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with probe_for(model, optimizer) as probe:
        with torch.autocast("cpu", dtype=torch.float16):
            step(model, optimizer, lambda out: torch.softmax(out, -1)[:, 0].mean(), probe,
                 torch.ones(2, 4))  # fmt: skip
        found = signals(probe)
    site, _ = found[(SOFTMAX_SPREAD, None, softmax_watch.SOFTMAX)]
    assert (site.dtype, site.logged) == ("float16", False)
    assert site.limit == pytest.approx(17.33, 1e-3)


def test_a_softmax_s_spread_is_its_widest_row_and_a_masked_row_counts_zero():
    model = nn.Identity()
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    rows = torch.tensor([[0.0, -5.0, 3.0], [0.0, -torch.inf, 30.0], [1.0, 1.0, 1.0]])
    probe = probe_for(model, optimizer)
    with probe:
        probe.step_started(StepContext(RUNS[id(probe)], 0, None))
        F.softmax(rows, -1)  # NB: through Tensor.softmax, as F.softmax calls it
        found = signals(probe)
    _, spread = found[(SOFTMAX_SPREAD, None, softmax_watch.SOFTMAX)]
    assert spread == 8.0  # the first row's; the second holds a masked position


@pytest.mark.parametrize("sdpa", [False, True])
def test_an_attention_s_largest_logit_is_named_by_its_module(sdpa):
    torch.manual_seed(0)
    model = Net(sdpa=sdpa)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 5, 8)
    q, k, _ = model.attn.qkv(x).unsqueeze(1).chunk(3, dim=-1)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8))[:1]  # NB: SDPA's: the first sequence
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    largest = scores.masked_fill(causal, -torch.inf).amax().item()
    with probe_for(model, optimizer) as probe:
        step(model, optimizer, lambda out: out.pow(2).mean(), probe, x)
        found = signals(probe)
    op = softmax_watch.SDPA if sdpa else softmax_watch.SOFTMAX
    site, value = found[(ATTENTION_LOGIT, "attn", op)]
    if sdpa:
        assert value == pytest.approx(largest, rel=1e-5)
    else:
        full = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(causal, -torch.inf)
        assert value == pytest.approx(full.amax().item(), rel=1e-5)
    assert site.dtype == "float32"


def test_module_outputs_are_measured_where_they_own_weights_or_hold_modules():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 5, 8)
    turns = []
    with probe_for(model, optimizer) as probe:
        for n in range(2):  # NB: the modules take turns, each measured every other step
            ctx = step(model, optimizer, lambda out: out.pow(2).mean(), probe, x, number=n)
            found = signals(probe)
            turns.append({module for metric, module, _ in found if metric == ACTIVATION_PEAK})
            probe.step_ended(ctx)
    # NB: not the GELU (its output is its input's); the root, in the turn the head is not
    assert turns[0] | turns[1] == {"", "attn", "attn.qkv", "head"}
    assert not turns[0] & turns[1]


def test_each_parameter_group_s_update_to_weight_ratio_is_measured():
    model = Pair()
    a, b = model.a, model.b
    optimizer = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    with probe_for(model, optimizer) as probe:
        step(model, optimizer, lambda out: out, probe, torch.zeros(1))
        found = signals(probe)
    ratios = {m: v for (metric, m, _), (_, v) in found.items() if metric == UPDATE_RATIO}
    # |dw| / |w|: 0.1 * |1| / |1| and 0.01 * |1| / |2|, each over its group's 10 values
    assert ratios == {
        "param_groups.0": pytest.approx(0.1),
        "param_groups.1": pytest.approx(0.005),
    }


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.ones(10)), nn.Parameter(torch.full((10,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a.sum() + self.b.sum()


def test_the_probe_leaves_no_trace():
    model = Net()
    before = (torch.softmax, torch.Tensor.softmax, torch.log, F.scaled_dot_product_attention)
    hooks = {n: dict(m._forward_hooks) for n, m in model.named_modules()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with probe_for(model, optimizer):
        assert torch.softmax is not before[0]  # wrapped while it listens
    after = (torch.softmax, torch.Tensor.softmax, torch.log, F.scaled_dot_product_attention)
    assert after == before and "softmax" not in vars(torch.Tensor)
    assert {n: dict(m._forward_hooks) for n, m in model.named_modules()} == hooks


@pytest.mark.parametrize("at_once", [True, False])
def test_the_signals_ride_on_the_sentinel_s_read_the_same_either_way(at_once):
    """On the CPU the sentinel reads a step when it ends; on CUDA its packed row, copied a
    step late: the signals follow the row there, in the same read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = HookedRun(model=model, given_optimizer=optimizer, device=torch.device("cpu"))
    run.note_optimizer(optimizer)
    sentinel = Sentinel(run, defer=False)
    if not at_once:
        sentinel._at_once = (torch.device("cpu"), False)  # NB: the packed row, as on CUDA
    precursors, forecaster = forecasting(sentinel, run)
    probes = Probes(sentinel, precursors)
    x = torch.randn(16, 4)
    with probes:
        ctx = StepContext(run, 0, x)
        probes.step_started(ctx)
        probes.phase_started(ctx, Phase.LOSS)
        loss = torch.log(torch.softmax(model(x), -1)).mean().neg()
        ctx.loss = loss
        probes.phase_ended(ctx, Phase.LOSS)
        optimizer.zero_grad()
        loss.backward()
        probes.phase_ended(ctx, Phase.BACKWARD)
        probes.phase_started(ctx, Phase.OPTIMIZER)
        optimizer.step()
        probes.phase_ended(ctx, Phase.OPTIMIZER)
        probes.step_ended(ctx)
        (verdict,) = list(sentinel.collect(final=True))
    layout, values = verdict.reading.carried
    read = {s.metric: v for s, v in layout.read(values)}
    assert set(read) == {ACTIVATION_PEAK, SOFTMAX_SPREAD, UPDATE_RATIO}
    assert verdict.reading.loss == pytest.approx(loss.item())
    assert forecaster.observe(0, verdict.reading.loss, 1.0, None, False, (layout, values)) == []


WRAPPED = [
    (torch, "softmax"),
    (torch.Tensor, "softmax"),
    (torch, "log_softmax"),
    (torch.Tensor, "log_softmax"),
    (torch, "log"),
    (torch.Tensor, "log"),
    (F, "scaled_dot_product_attention"),
]


def callables() -> list:
    return [getattr(owner, name) for owner, name in WRAPPED]


def guarded_loop(nan_at: int | None = None):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(2, 5, 8) for _ in range(4)]
    if nan_at is not None:
        batches[nan_at][0, 0, 0] = float("nan")

    def train_step(x):
        optimizer.zero_grad()
        loss = -torch.log(torch.softmax(model(x), -1))[..., 0].mean()
        loss.backward()
        optimizer.step()

    return model, optimizer, batches, train_step


def raised_in_the_with_form():
    model, optimizer, batches, train_step = guarded_loop()
    with pytest.raises(KeyError), nandoctor.Guard(model, optimizer):
        train_step(batches[0])
        model(batches[1])  # the forecast listening: the loss under way
        raise KeyError("the user's own")


def raised_in_a_guard_step():
    model, optimizer, batches, train_step = guarded_loop()
    guard = nandoctor.Guard(model, optimizer)

    def failing(x):
        model(x)
        raise KeyError("the user's own")

    guard.step(train_step, batches[0])
    with pytest.raises(KeyError):
        guard.step(failing, batches[1])
    # NB: never closed: the guard.step form need not be


def failed_at_a_nan():
    model, optimizer, batches, train_step = guarded_loop(nan_at=2)
    with pytest.raises(nandoctor.NonFiniteError), nandoctor.Guard(model, optimizer):
        for x in batches:
            train_step(x)


EXITS = {
    "the user's exception in the with form": raised_in_the_with_form,
    "the user's exception in guard.step": raised_in_a_guard_step,
    "a NonFiniteError": failed_at_a_nan,
}


@pytest.mark.parametrize("leave", EXITS.values(), ids=EXITS)
def test_every_way_out_gives_torch_its_own_callables_back(leave):
    """The forecast wraps torch's softmaxes, logs and attention while it listens
    (`runtime.wrappers`); however the run ends, each is the very object it was."""
    from torch.nn.modules import module as nn_module

    before = callables()
    leave()
    assert all(a is b for a, b in zip(callables(), before, strict=True))
    assert not {"softmax", "log_softmax", "log"} & set(vars(torch.Tensor))
    assert not nn_module._global_forward_hooks  # the forecast's hook too


def test_between_guard_steps_torch_is_its_own():
    """`guard.step` puts the forecast's wrappers and hook on for each step alone, as its
    own hooks: a loop that never calls `guard.close()` leaves nothing in torch (they
    stayed on from the first step until the guard closed)."""
    model, optimizer, batches, train_step = guarded_loop()
    guard = nandoctor.Guard(model, optimizer)
    before, inside = callables(), []

    def step_and_look(x):
        inside.append(torch.softmax is before[0])
        train_step(x)

    for x in batches:
        guard.step(step_and_look, x)
        assert all(a is b for a, b in zip(callables(), before, strict=True))
    assert inside == [False] * len(batches)  # wrapped inside each step: the forecast listened
    assert guard.report is None


class Told:
    """A listener that counts what it is told."""

    def __init__(self) -> None:
        self.softmaxes: list[str] = []

    def softmax_called(self, op, x, dim, out) -> None:
        self.softmaxes.append(op)

    def attention_called(self, args, kwargs) -> None:
        pass

    def log_called(self, x) -> None:
        pass


def test_a_user_s_torch_function_mode_sees_each_call_once_and_the_listener_is_told_once():
    """A user's `TorchFunctionMode` keeps working while the wrappers are on: torch hands
    it a method as it finds it on `torch.Tensor`, the wrapper then (the identity a mode
    may compare with, as docs/forecast.md says), and the mode's call of it reaches the
    wrapper again, which tells the listener once."""
    from torch.overrides import TorchFunctionMode

    from nandoctor.runtime import wrappers

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    x, told = torch.randn(2, 3), Told()
    original = torch.softmax
    wrappers.listen_softmaxes(told)
    try:
        with Seen() as mode:
            x.softmax(-1)
            torch.softmax(x, -1)
        assert mode.funcs == [torch.Tensor.softmax, original]  # the wrapper; torch's own
    finally:
        wrappers.stop_listening_softmaxes(told)
    assert told.softmaxes == [softmax_watch.SOFTMAX] * 2


def test_a_patch_the_user_puts_over_a_wrapper_stays_when_the_listening_ends():
    """Each callable is restored to its own object only where the wrapper still is: a
    replacement the user made during the run is the user's to keep."""
    from nandoctor.runtime import wrappers

    told, original = Told(), torch.log_softmax

    def mine(*args, **kwargs):
        return original(*args, **kwargs)

    wrappers.listen_softmaxes(told)
    torch.log_softmax = mine
    try:
        wrappers.stop_listening_softmaxes(told)
        assert torch.log_softmax is mine
    finally:
        torch.log_softmax = original
    assert not {"softmax", "log_softmax", "log"} & set(vars(torch.Tensor))  # the rest: theirs
