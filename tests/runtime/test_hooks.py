"""`StepHooks`: a user's own loop announced phase by phase, and the light hooks that
replace the global module hooks once the model's own calls are all a step runs."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from nandoctor.runtime import module_hooks
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.module_hooks import LIGHT_AFTER
from nandoctor.runtime.probe import Phase, Probe, StepContext


class Events(Probe):
    """Every announcement, with the batch's keys and sum at INPUT and the loss at LOSS."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def step_started(self, ctx: StepContext) -> None:
        self.seen.append((ctx.step, "step"))

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.INPUT:
            batch = ctx.batch
            keys = tuple(sorted(batch)) if isinstance(batch, dict) else type(batch).__name__
            self.seen.append((ctx.step, "input", keys))
        else:
            self.seen.append((ctx.step, "start", phase.value))

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        detail = round(ctx.loss.item(), 4) if phase is Phase.LOSS else None
        self.seen.append((ctx.step, "end", phase.value, detail))

    def step_ended(self, ctx: StepContext) -> None:
        self.seen.append((ctx.step, "done"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = self.body(x)
        return out if scale is None else out * scale


def loop(
    steps: int,
    *,
    head: bool = False,
    probe: Probe | None = None,
    named: bool = False,
    per_step: bool = False,
    explicit: bool = False,
):
    """Train `steps` steps under StepHooks as `watch` does (no model given); with `head`,
    a second module with parameters runs on the model's output, `head(model(x))`; with
    `per_step`, the hooks are attached for each step alone (as the benchmark does); with
    `explicit`, as `guard.step` does: for each step alone, which it begins and ends."""
    torch.manual_seed(0)
    model, second = Net(), nn.Linear(3, 3)
    params = [*model.parameters(), *(second.parameters() if head else ())]
    optimizer = torch.optim.SGD(params, lr=0.1)
    g = torch.Generator().manual_seed(1)
    probe = probe or Events()
    global_hooks: list[int] = []
    hooks = StepHooks(HookedRun(), probe, explicit=explicit)
    per_step = per_step or explicit
    with hooks if not per_step else contextlib.nullcontext():
        for _ in range(steps):
            with hooks if per_step else contextlib.nullcontext():
                x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
                if named:
                    hooks.name_batch({"x": x, "y": y})
                if explicit:
                    hooks.begin({"x": x, "y": y})
                optimizer.zero_grad()
                out = model(x, scale=torch.ones(1))
                loss = F.cross_entropy(second(out) if head else out, y)
                loss.backward()
                optimizer.step()
                if explicit:
                    hooks.end()
                global_hooks.append(len(nn_module._global_forward_pre_hooks))
    return probe, global_hooks, model


def test_after_regular_steps_the_model_alone_is_hooked_and_announces_the_same_phases(
    monkeypatch,
):
    before = len(nn_module._global_forward_pre_hooks)
    light, hooked, model = loop(6)
    # counted as each step ends: the LIGHT_AFTER-th regular step ends in light mode
    assert hooked == [before + 1] * (LIGHT_AFTER - 1) + [before] * (7 - LIGHT_AFTER)
    monkeypatch.setattr(module_hooks, "LIGHT_AFTER", 10**9)
    full, hooked, _ = loop(6)
    assert hooked == [before + 1] * 6
    assert light.seen == full.seen
    assert (5, "input", ("0", "scale")) in light.seen  # keyword inputs too
    assert not model._forward_pre_hooks and not model._forward_hooks  # all removed at exit


def test_hooks_attached_again_resume_in_light_mode(monkeypatch):
    before = len(nn_module._global_forward_pre_hooks)
    light, hooked, model = loop(5, per_step=True)
    assert hooked == [before + 1] * (LIGHT_AFTER - 1) + [before] * (6 - LIGHT_AFTER)
    assert light.seen == loop(5)[0].seen
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("head", [False, True], ids=["the model alone", "with a head"])
def test_explicit_steps_go_light_as_a_watched_loop_does(head, monkeypatch):
    """`guard.step` keeps one set of hooks across its steps: after regular steps, the
    model's own calls alone are hooked, and every step is announced as before."""
    before = len(nn_module._global_forward_pre_hooks)
    probe, hooked, model = loop(5, explicit=True, head=head)
    light = [before] * (6 - LIGHT_AFTER) if not head else [before + 1] * (6 - LIGHT_AFTER)
    assert hooked == [before + 1] * (LIGHT_AFTER - 1) + light
    monkeypatch.setattr(module_hooks, "LIGHT_AFTER", 10**9)
    assert probe.seen == loop(5, explicit=True, head=head)[0].seen
    assert (4, "input", ("x", "y")) in probe.seen and (4, "done") in probe.seen
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_second_root_module_keeps_the_global_hooks_for_good():
    before = len(nn_module._global_forward_pre_hooks)
    probe, hooked, _ = loop(5, head=True)
    assert hooked == [before + 1] * 5
    forwards = [e for e in probe.seen if e[0] == 4 and e[1:3] == ("start", "forward")]
    assert len(forwards) == 2  # the model's forward and the head's, each announced


def test_a_framework_that_names_its_batch_keeps_the_global_hooks():
    before = len(nn_module._global_forward_pre_hooks)
    probe, hooked, _ = loop(4, named=True)
    assert hooked == [before + 1] * 4
    assert (3, "input", ("x", "y")) in probe.seen


@pytest.mark.parametrize("light", [True, False])
def test_a_forward_that_raises_leaves_the_next_step_announced(light, monkeypatch):
    if not light:
        monkeypatch.setattr(module_hooks, "LIGHT_AFTER", 10**9)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Events()
    with StepHooks(HookedRun(), probe) as hooks:
        for step in range(5):
            x = torch.randn(4, 6 if step != 3 else 5)  # step 3's batch has the wrong width
            try:
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()
            except RuntimeError:
                hooks.abandon()
    assert [e[0] for e in probe.seen if e[1] == "done"] == [0, 1, 2, 3]
    assert (3, "start", "forward") in probe.seen  # the fifth batch, the fourth step


def gan_loop(steps: int, order: str, g_steps_until: int | None = None) -> list[tuple]:
    """A GAN's loop under StepHooks as `watch` runs it (nothing given): the discriminator D
    and the generator G, an optimizer each, both stepped in every iteration, in `order`
    ("D, G": the DCGAN loop's). Returns (iteration, model, the step its work was counted
    in) for each model's part, read just before its optimizer steps; with
    `g_steps_until`, G steps only in the iterations before it."""
    torch.manual_seed(0)
    G, D = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6)), Net()
    opt_g, opt_d = torch.optim.AdamW(G.parameters(), 1e-3), torch.optim.AdamW(D.parameters(), 1e-3)
    seen: list[tuple] = []
    with StepHooks(HookedRun(), Events()) as hooks:

        def d_part(i: int, real: torch.Tensor, fake: torch.Tensor) -> None:
            opt_d.zero_grad()
            (F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()).backward()
            seen.append((i, "D", hooks.ctx.step if hooks.ctx else None))
            opt_d.step()

        def g_part(i: int, fake: torch.Tensor) -> None:
            opt_g.zero_grad()
            F.softplus(-D(fake)).mean().backward()
            seen.append((i, "G", hooks.ctx.step if hooks.ctx else None))
            opt_g.step()

        for i in range(steps):
            real, fake = torch.randn(5, 6), G(torch.randn(5, 4))
            trains_g = g_steps_until is None or i < g_steps_until
            if order == "D, G":
                d_part(i, real, fake)
                if trains_g:
                    g_part(i, fake)
            else:
                g_part(i, fake)
                d_part(i, real, fake)
    return seen


@pytest.mark.parametrize("order", ["D, G", "G, D"])
def test_a_gan_loop_is_one_step_an_iteration_both_models_work_included(order):
    """Steps are numbered by the first optimizer to step, and each holds the whole
    iteration: the second model's forward, backward and step are that iteration's, not
    the next step's. Only the first iteration's second part, met before the loop's order
    is known, counts toward step 1."""
    first, second = order.split(", ")
    seen = gan_loop(6, order)
    assert (0, first, 0) in seen and (0, second, 1) in seen
    later = [(i, model, step) for i, model, step in seen if i > 0]
    assert later == [(i, m, i) for i in range(1, 6) for m in (first, second)]


def test_a_loop_that_stops_stepping_its_second_optimizer_is_numbered_by_the_first_again():
    """G steps in the first three iterations only: the step that waited for G's step ends
    when D steps again (the forward and backward before that step were already counted
    in it: iteration 4's in step 3), and from there each step of D is a step, numbered
    as before: D's step of iteration i is step i."""
    seen = gan_loop(7, "D, G", g_steps_until=3)
    work = [(i, i) for i in range(4)] + [(4, 3), (5, 5), (6, 6)]
    assert [(i, step) for i, model, step in seen if model == "D"] == work
    assert [(i, step) for i, model, step in seen if model == "G" and i > 0] == [(1, 1), (2, 2)]


def test_an_optimizer_made_anew_each_epoch_numbers_the_steps_from_then_on():
    """Older code lowers its rate by making a new optimizer each epoch: the new one steps
    the same parameters and takes over the numbering (the old one never steps again; it
    stopped the count at the first epoch's end, and a NaN after it went unseen)."""
    torch.manual_seed(0)
    model = Net()
    probe = Events()
    with StepHooks(HookedRun(), probe):
        for epoch in range(3):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / (epoch + 1))
            for _ in range(2):
                optimizer.zero_grad()
                model(torch.randn(3, 6)).sum().backward()
                optimizer.step()
    assert [e[0] for e in probe.seen if e[1] == "done"] == [0, 1, 2, 3, 4, 5]


def gpt2_loop(steps: int, probe: Probe, nan_at: int | None = None) -> None:
    """transformers' GPT-2 (tiny, random-init, no dropout) called as `model(**batch)`,
    its loss from the library; batch `nan_at` has a NaN in its float attention mask."""
    pytest.importorskip("transformers")
    from tests.helpers.real_models import gpt2, lm_data

    torch.manual_seed(0)
    model = gpt2(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = lm_data(batches=steps)
    with StepHooks(HookedRun(), probe):
        for step, batch in enumerate(batches):
            mask = torch.ones(batch["input_ids"].shape)
            if step == nan_at:
                mask[1, 3] = float("nan")
            optimizer.zero_grad()
            model(**batch, attention_mask=mask).loss.backward()
            optimizer.step()


def test_on_gpt2_called_by_keyword_the_light_hooks_announce_what_the_global_ones_do(
    monkeypatch,
):
    light = Events()
    gpt2_loop(5, light)
    monkeypatch.setattr(module_hooks, "LIGHT_AFTER", 10**9)
    full = Events()
    gpt2_loop(5, full)
    assert light.seen == full.seen
    assert (4, "input", ("attention_mask", "input_ids", "labels")) in light.seen


class ForwardUnderAutocast(Net):
    """accelerate's and transformers' Trainer's way: `model.forward` wrapped in autocast,
    entered after the model's own hooks have run."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(x, scale).float()


@pytest.mark.parametrize(
    ("model", "dtype"),
    [(Net, torch.float32), (ForwardUnderAutocast, torch.bfloat16)],
)
def test_the_runs_dtype_is_the_autocast_its_models_forward_enters(model, dtype):
    """The model's first call sees no autocast when its forward enters one itself: the
    modules inside it do, and their dtype is the run's (it read float32)."""
    run = HookedRun()
    net = model()
    with StepHooks(run, Probe()):
        loss = net(torch.randn(4, 6)).sum()
        loss.backward()
    assert run.dtype == dtype


def test_an_autocast_the_loop_enters_is_the_runs_dtype_at_the_models_call():
    run = HookedRun()
    with StepHooks(run, Probe()), torch.autocast("cpu", dtype=torch.bfloat16):
        Net()(torch.randn(4, 6)).float().sum().backward()
    assert run.dtype == torch.bfloat16 and not run.dtype_from_weights


def test_a_clip_in_two_calls_is_seen():
    """`get_total_norm` then `clip_grads_with_norm_`, torch's split form: accelerate's
    `clip_grad_norm_` (so the transformers Trainer's clip) imports it per call, and the
    report said "no gradient clipping is configured" of loops that clipped so."""
    run = HookedRun()
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with StepHooks(run, Probe()):
        net(torch.randn(4, 6)).sum().backward()
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm  # NB: as accelerate

        grads = [p.grad for p in net.parameters()]
        clip_grads_with_norm_(net.parameters(), 1.5, get_total_norm(grads))
        optimizer.step()
    assert run.clip_grad_norm == 1.5


def test_a_norm_measured_with_an_infinite_max_norm_is_no_clipping():
    """`clip_grad_norm_(params, inf)` is how loops (and the Trainer) measure the norm."""
    run = HookedRun()
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with StepHooks(run, Probe()):
        net(torch.randn(4, 6)).sum().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), float("inf"))
        optimizer.step()
    assert run.clip_grad_norm is None


def test_accelerates_clip_is_seen():
    accelerate = pytest.importorskip("accelerate")
    run = HookedRun()
    accelerator = accelerate.Accelerator(cpu=True)
    net = Net()
    net, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with StepHooks(run, Probe()):
        accelerator.backward(net(torch.randn(4, 6)).sum())
        accelerator.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
    assert run.clip_grad_norm == 0.5


def test_a_clip_imported_by_name_before_the_hooks_is_seen():
    """`from torch.nn.utils import clip_grad_norm_` at a script's top binds the function
    before any hook is attached: the clip is still the run's (exploding-gradients told
    such a loop to add the clipping it already did)."""
    from torch.nn.utils import clip_grad_norm_  # NB: bound now, before the hooks

    run = HookedRun()
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with StepHooks(run, Probe()):
        net(torch.randn(4, 6)).sum().backward()
        clip_grad_norm_(net.parameters(), 2.5)
        optimizer.step()
    assert run.clip_grad_norm == 2.5


def as_saved(obj: object) -> bytes:
    """`torch.save(obj)` into memory, as a script saves its whole model."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("light", [True, False])
def test_a_followed_loop_leaves_its_objects_as_they_would_be_unwatched(light, monkeypatch):
    """Nothing of nandoctor's is reachable from the loop's objects while it watches: the
    model pickles (`torch.save(model, f)` raised "cannot pickle 'WeakIdRef' object"
    under watch), deep-copies into an EMA without hooks, and shows the same hooks,
    modules, parameters and state as an unwatched twin; the optimizer, scaler and
    scheduler pickle as they are."""
    import copy

    if not light:
        monkeypatch.setattr(module_hooks, "LIGHT_AFTER", 10**9)
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    scaler = torch.amp.GradScaler("cpu")
    probe = Events()
    with StepHooks(HookedRun(), probe):
        for _ in range(4):
            optimizer.zero_grad()
            scaler.scale(model(torch.randn(4, 6), scale=torch.ones(1)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            assert vars(model).keys() == vars(twin).keys()
            for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_with_kwargs"):
                assert not getattr(model, name), name
            saved = as_saved(model)  # mid-run, between steps
            ema = copy.deepcopy(model)
            assert [n for n, _ in ema.named_modules()] == [n for n, _ in twin.named_modules()]
            assert not ema._forward_pre_hooks and not ema._forward_hooks
            with torch.no_grad():
                ema(torch.randn(4, 6))  # the EMA's evaluation
        as_saved({"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler})
    loaded = torch.load(__import__("io").BytesIO(saved), weights_only=False)
    assert type(loaded) is Net and loaded.state_dict().keys() == twin.state_dict().keys()
    assert [p.shape for p in loaded.parameters()] == [p.shape for p in twin.parameters()]
    twin.load_state_dict(loaded.state_dict())  # the same keys, loadable both ways
    assert type(model).__call__ is nn.Module.__call__  # the class's own again


def test_a_manual_update_without_an_optimizer_is_a_step_each_time_the_gradients_reset():
    """pytorch/examples' word language model updates its weights by hand
    (`p.data.add_(p.grad, alpha=-lr)`, no optimizer): a step ends when the model is
    called again after the loop reset its gradients (`model.zero_grad()`), and the last
    one when the run ends (`finish`). It read "no training step was seen" of a NaN run."""
    torch.manual_seed(0)
    model = Net()
    probe = Events()
    with StepHooks(HookedRun(), probe) as hooks:
        for step in range(4):
            model.zero_grad(set_to_none=step % 2 == 0)  # None, or zeroed in place
            model(torch.randn(4, 6)).sum().backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.1)
            with torch.no_grad():  # an evaluation between steps is no step
                model(torch.randn(2, 6))
        assert hooks.finish() == 3
    assert [e[0] for e in probe.seen if e[1] == "done"] == [0, 1, 2, 3]
    assert [e[0] for e in probe.seen if e[1:] == ("start", "backward")] == [0, 1, 2, 3]


def test_gradient_accumulation_before_the_first_optimizer_step_is_one_step():
    """Gradients that carry on between backwards are accumulated, not reset: the
    micro-batches before the first optimizer step are its step's, not steps of their own."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Events()
    with StepHooks(HookedRun(), probe) as hooks:
        for _ in range(2):
            optimizer.zero_grad()
            for _ in range(3):
                model(torch.randn(4, 6)).sum().backward()
            optimizer.step()
        assert hooks.finish() is None
    assert [e[0] for e in probe.seen if e[1] == "done"] == [0, 1]
    assert [e[0] for e in probe.seen if e[1:] == ("start", "backward")] == [0] * 3 + [1] * 3


@pytest.mark.parametrize("form", ["module", "function"])
def test_a_compiled_model_raises_no_warning_and_keeps_its_steps(form, recwarn):
    """`torch.compile(model)` warned at each call about nandoctor's global module hooks
    ("... will cause the hooks to fire an extra time"), three times into a watched
    script's output: they stand aside while a compiled module runs, whose call is the
    model's forward. A compiled function runs the model inside it: its steps are the
    optimizer's all the same."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Events()
    with StepHooks(HookedRun(), probe):
        if form == "module":
            step_forward = torch.compile(model, backend="eager")
        else:
            step_forward = torch.compile(lambda x: model(x), backend="eager")
        for _ in range(4):
            optimizer.zero_grad()
            step_forward(torch.randn(4, 6)).sum().backward()
            optimizer.step()
    assert not [w for w in recwarn if "global hooks" in str(w.message)]
    assert [e[0] for e in probe.seen if e[1] == "done"] == [0, 1, 2, 3]
    forwards = [e[0] for e in probe.seen if e[1:] == ("start", "forward")]
    assert forwards == ([0, 1, 2, 3] if form == "module" else [])
    assert not nn_module._has_any_global_hook()  # its with-kwargs entry gone too
