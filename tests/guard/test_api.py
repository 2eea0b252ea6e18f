"""The Python API: `Guard` in a user's own loop, `NonFiniteError` with the report of
diagnose, in both forms (`guard.step(fn, batch)` replays and localises; `with guard:`
watches an unchanged loop through hooks)."""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from transformers import BatchEncoding

import nandoctor
from nandoctor.errors import ExitCode, NandoctorError, UsageError
from nandoctor.examples.seed import build_data, build_model
from nandoctor.guard import Guard, NonFiniteError
from nandoctor.render.markdown import render_markdown
from nandoctor.render.terminal import render_report
from nandoctor.report.types import Report
from nandoctor.runtime.judge import MAX_SKIP_STREAK
from tests.scripts import seed_fp16_nan as seed
from tests.scripts.expected import seed_diagnosis


def tiny_loop(nan_at: int | None = None, steps: int = 8):
    """A float32 model, optimizer and batches; batch `nan_at` holds one NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(steps)
    ]
    if nan_at is not None:
        batches[nan_at][0][2, 5] = float("nan")

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return model, optimizer, batches, train_step


def guarded(guard: Guard, train_step, batches) -> list[torch.Tensor]:
    return [guard.step(train_step, batch) for batch in batches]


def test_guard_step_catches_an_input_nan_at_its_exact_step():
    model, optimizer, batches, train_step = tiny_loop(nan_at=5)
    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError) as caught:
        guarded(guard, train_step, batches)
    report = caught.value.report
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor, first.value) == (5, "input", "input:0", "nan")
    assert first.reproduced == "exact" and first.count_nonfinite == 1
    assert report.steps_completed == 5 and report.status == "nonfinite"
    assert report.causes[0].id == "nonfinite-input"
    assert guard.report is report


def test_guard_step_replays_from_kept_steps_whose_buffers_were_reused():
    """With a snapshot every 2 steps, the steps kept before step 9 were copied into the
    buffers of dropped ones; a step that edits its batch in place changes none of them."""
    model, optimizer, batches, train_step = tiny_loop(nan_at=9, steps=12)

    def editing_step(batch):
        out = train_step(batch)
        batch[0].mul_(0.5)  # after its use: only a replay could see the edit
        return out

    guard = Guard(model, optimizer, snapshot_every=2)
    with pytest.raises(NonFiniteError) as caught:
        guarded(guard, editing_step, batches)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (9, "input", "input:0")
    assert first.reproduced == "exact" and first.count_nonfinite == 1


def test_guard_step_replays_a_batch_encoding_the_step_took_apart_as_it_came():
    """transformers' collators hand out `BatchEncoding`s, and a step often pops its labels
    off the batch: each replay gets its own copy of the batch as the step first saw it."""
    model, optimizer, batches, train_step = tiny_loop(nan_at=5)

    def popping_step(batch):
        labels = batch.pop("labels")
        return train_step((batch["x"], labels))

    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError) as caught:
        for x, y in batches:
            guard.step(popping_step, BatchEncoding({"x": x, "labels": y}))
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (5, "input", "input:x")
    assert first.reproduced == "exact" and first.count_nonfinite == 1


def test_guard_step_rewinds_a_parameter_the_optimizer_trains_outside_the_model():
    """A learnable temperature in the loss (CLIP-style): the replay starts from its value
    at the snapshot, not from the NaN the failing step left in it."""
    model, _, batches, _ = tiny_loop(nan_at=6, steps=10)
    log_tau = nn.Parameter(torch.tensor(0.0))
    optimizer = torch.optim.Adam([*model.parameters(), log_tau], lr=0.05)

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(model(x) / log_tau.exp(), y).backward()
        optimizer.step()

    with pytest.raises(NonFiniteError) as caught:
        guarded(Guard(model, optimizer, snapshot_every=4), train_step, batches)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (6, "input", "input:0")
    assert first.reproduced == "exact"


def test_in_a_jupyter_cell_the_guard_and_its_error_show_the_report():
    model, optimizer, batches, train_step = tiny_loop(nan_at=3)
    guard = Guard(model, optimizer)
    guarded(guard, train_step, batches[:2])
    assert guard._repr_markdown_() == "**nandoctor Guard**: watching; 2 finite steps so far."
    with pytest.raises(NonFiniteError) as caught:
        guarded(guard, train_step, batches[2:])
    shown = guard._repr_markdown_()
    assert shown == render_markdown(guard.report) == caught.value._repr_markdown_()
    assert "non-finite at step 3" in shown


def test_the_error_carries_a_report_every_renderer_and_the_json_read():
    model, optimizer, batches, train_step = tiny_loop(nan_at=2)
    with pytest.raises(NonFiniteError) as caught:
        guarded(Guard(model, optimizer, name="my-loop"), train_step, batches)
    error = caught.value
    assert isinstance(error, NandoctorError) and error.exit_code == ExitCode.NONFINITE
    assert "step 2, phase input" in error.message and error.hint.startswith("nonfinite-input")
    report = error.report
    assert Report.from_dict(report.to_dict()).to_dict() == report.to_dict()
    assert report.command == "guard" and report.name == "my-loop"  # as diagnose's `name`
    assert report.config == sys.argv[0]  # the script
    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    render_report(console, report)
    assert "NON-FINITE at step 2" in console.file.getvalue()
    assert "step 2" in render_markdown(report)


def seed_loop():
    """The brief's loop (configs/seed-fp16-nan.yaml, as the watch script mirrors it) as a
    step function."""
    torch.manual_seed(seed.SEED)
    model = build_model(**seed.MODEL_ARGS)
    data = build_data(**seed.DATA_ARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=seed.LR, momentum=seed.MOMENTUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=seed.INIT_SCALE)

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return model, optimizer, scaler, data, train_step


def test_guard_step_localises_the_seed_loop_as_diagnose_does():
    model, optimizer, scaler, data, train_step = seed_loop()
    guard = Guard(model, optimizer, scaler)
    with pytest.raises(NonFiniteError) as caught:
        for step in range(400):
            guard.step(train_step, data[step % len(data)])
    report, expected = caught.value.report, seed_diagnosis()
    first = report.first_nonfinite
    assert (first.step, first.phase) == (expected["first_nonfinite"]["step"], "loss")
    assert (first.op, first.tensor, first.value) == ("aten.log.default", "output", "-inf")
    assert first.source.endswith(f"test_api.py:{seed_loop_loss_line()}")
    assert [c.id for c in report.causes] == [c["id"] for c in expected["causes"]]
    assert [(e.step, e.kind, e.reason, e.cause) for e in report.events] == [
        (e["step"], e["kind"], e.get("reason"), e.get("cause")) for e in expected["events"]
    ]  # the skips rerun at loss scale 1 through the kept steps, the forecasts: as diagnose's
    assert [f.kind for f in report.forecast] == [f["kind"] for f in expected["forecast"]]
    assert report.evidence.update == expected_update(expected)
    assert all(c.verified is None for c in report.causes)  # nandoctor cannot rerun your loop


def expected_update(expected: dict):
    from pydantic import TypeAdapter

    from nandoctor.report.evidence import UpdateRatio

    return TypeAdapter(UpdateRatio).validate_python(expected["evidence"]["update"])


def seed_loop_loss_line() -> int:
    import inspect

    lines, start = inspect.getsourcelines(seed_loop)
    return start + next(i for i, line in enumerate(lines) if "torch.log(" in line)


def test_the_with_form_watches_an_unchanged_loop_by_optimizer_steps():
    model, optimizer, batches, train_step = tiny_loop(nan_at=4)
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for batch in batches:
            train_step(batch)  # the user's loop, untouched
    report = caught.value.report
    first = report.first_nonfinite
    assert (first.step, first.phase, first.reproduced) == (4, "input", None)  # none replayed
    # NB: no replay, yet the batch tensor is named: the sentinel kept the step's batch
    assert (first.tensor, first.value, first.count_nonfinite) == ("input:0", "nan", 1)
    assert "held 1 NaN value in input:0" in report.causes[0].evidence[0]


def test_the_with_form_judges_as_diagnose_does_at_the_sentinels_cost(monkeypatch):
    """One sentinel for every driver: a NaN born inside the model shows as the loss phase
    (as in diagnose's fast run; only a replay names the op), and a step costs the
    sentinel's passes: the weights checked once at the start, the weights and the batch
    only of the step that failed (to name its phase), never the model's output or the
    weights after each update."""
    import nandoctor.runtime.sentinel as sentinel_module

    model, optimizer, batches, _ = tiny_loop()
    checked: list[int] = []  # NB: the exact checks: one pass over their tensors each
    for name in ("nonfinite", "nonfinite_data"):  # NB: the batch's spares additive masks
        real = getattr(sentinel_module, name)
        counted = lambda ts, d, real=real: checked.append(len(ts)) or real(ts, d)  # noqa: E731
        monkeypatch.setattr(sentinel_module, name, counted)

    def train_step(step, batch):
        x, y = batch
        optimizer.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out * float("nan") if step == 3 else out, y)
        loss.backward()
        optimizer.step()

    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for step, batch in enumerate(batches):
            train_step(step, batch)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.reproduced) == (3, "loss", None)
    params = len(list(model.parameters()))
    # the weights once; in step 3, as its loss turned NaN, the weights, then its batch
    assert checked == [params, params, 1]


def test_guard_step_traces_weights_an_update_broke_back_to_that_update():
    """Adam with eps=0 on a feature that is always zero: 0/0 in step 0's update. The
    sentinel meets the NaN weights in step 1's loss; the replay finds them already broken
    and traces the step before, as diagnose does."""
    model, _, batches, _ = tiny_loop()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    for x, _ in batches:
        x[:, 0] = 0.0

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    with pytest.raises(NonFiniteError) as caught:
        guarded(Guard(model, optimizer), train_step, batches)
    report = caught.value.report
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "optimizer", "0")
    assert (first.tensor, first.value) == ("param:0.weight", "nan")
    assert first.op in ("aten.addcdiv_.default", "aten._foreach_addcdiv_.ScalarList")
    assert report.steps_completed == 0


@pytest.mark.parametrize("form", ["step", "with"])
def test_weights_broken_between_steps_are_the_parameters_phase_in_both_forms(form):
    """A weight set to NaN outside the steps (a checkpoint reloaded mid-run): the step
    whose loss meets it fails in the parameters phase, with its cause; `guard.step`'s
    replay, from a snapshot taken before the edit, says the steps left them finite."""
    model, optimizer, batches, train_step = tiny_loop()
    guard = Guard(model, optimizer, snapshot_every=2)
    watching = guard if form == "with" else contextlib.nullcontext()
    with pytest.raises(NonFiniteError) as caught, watching:
        for step, batch in enumerate(batches):
            if step == 5:
                with torch.no_grad():
                    model[2].weight[1, 3] = float("nan")
            guard.step(train_step, batch) if form == "step" else train_step(batch)
    report = caught.value.report
    first = report.first_nonfinite
    replayed = "not-reproduced" if form == "step" else None  # NB: the replay saw them finite
    assert (first.step, first.phase, first.reproduced) == (5, "parameters", replayed)
    # NB: the replay met them finite: changed between steps, or a fault of the memory
    also = ["transient-fault"] if form == "step" else []
    assert [c.id for c in report.causes] == ["nonfinite-parameters", *also]
    if form == "step":
        assert any("something outside the steps changed them" in n for n in report.notes)


@pytest.mark.parametrize("form", ["step", "with"])
def test_a_guard_whose_model_the_loop_never_calls_says_so_once(form):
    """`Guard(model)` on a loop that runs the model inside a function compiled whole,
    whose inner calls no hook sees: one warning says what to give instead (the `with`
    form, which then has no batch, reads a NaN batch as the loss)."""
    torch._dynamo.reset()  # NB: a cached graph, or eager fallback, from another test
    model, optimizer, batches, _ = tiny_loop(nan_at=4)
    forward = torch.compile(lambda x: model(x), backend="aot_eager")

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        optimizer.step()

    guard = Guard(model, optimizer, raise_error=False)
    watching = guard if form == "with" else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, watching:
        warnings.simplefilter("always")
        for batch in batches[:6]:
            guard.step(train_step, batch) if form == "step" else train_step(batch)
    assert guard.report is not None
    said = [str(w.message) for w in caught if str(w.message).startswith("nandoctor")]
    assert len(said) == 1 and "step 0 trained without calling the model" in said[0]
    assert "(Sequential)" in said[0] and "torch.compile(model)" in said[0]
    phase = guard.report.first_nonfinite.phase
    assert phase == ("input" if form == "step" else "loss")  # guard.step names its batch


@pytest.mark.parametrize("order", ["G, D", "D, G"])
def test_two_with_guards_on_a_gan_each_count_their_own_models_steps(order):
    """A GAN's loop under two `with` guards, one per model and optimizer; the
    discriminator's real batch holds a NaN at step 3. The discriminator's step calls the
    generator (its fakes) and steps first, yet the generator's guard counts only its own
    optimizer's steps: whichever guard is entered first, the discriminator's reports."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    reals = [torch.randn(6, 8) for _ in range(6)]
    reals[3][2, 2] = float("nan")
    guards = {"G": Guard(G, opt_g, name="G"), "D": Guard(D, opt_d, name="D")}
    first, second = (guards[k] for k in order.split(", "))
    with pytest.raises(NonFiniteError) as caught, first, second:
        for real in reals:
            opt_d.zero_grad()
            fake = G(torch.randn(6, 4)).detach()
            (F.softplus(-D(real)).mean() + F.softplus(D(fake)).mean()).backward()
            opt_d.step()
            opt_g.zero_grad()
            F.softplus(-D(G(torch.randn(6, 4)))).mean().backward()
            opt_g.step()
    assert caught.value.report is guards["D"].report
    first_bad = caught.value.report.first_nonfinite
    assert (first_bad.step, first_bad.phase) == (3, "input")
    assert guards["G"].report is None and guards["G"].result.steps_completed == 3


def gan_fp16(nan_at: int | None = None):
    """A GAN's float16 loop with one GradScaler, whose first steps overflow (2**20): each
    step trains the discriminator, then the generator, each optimizer zeroed just before
    its own backward. `nan_at`: that step's real batch holds a NaN."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 1e-3), torch.optim.Adam(D.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=g), torch.randn(6, 8, generator=g)) for _ in range(12)]
    if nan_at is not None:
        batches[nan_at][1][2, 2] = float("nan")

    def train_step(batch):
        z, real = batch
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            loss_d = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
        opt_d.zero_grad()
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = F.softplus(-D(fake)).mean()
        opt_g.zero_grad()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()

    return (G, D, opt_g, opt_d, scaler), batches, train_step


def test_guard_step_on_a_gans_fp16_loop_rechecks_its_skips_and_changes_nothing():
    """Every overflow skip of the shared GradScaler is rechecked at scale 1 (the step
    rerun, the generator's gradients still the skipped step's when the discriminator's
    backward ends: not this step's, so no failure) and the run goes on exactly as it
    would without the guard: both models and both optimizers bit-identical (the
    discriminator and its optimizer, met as the loop ran, are put back after each
    recheck too)."""
    (G, D, opt_g, opt_d, _), batches, train_step = gan_fp16()
    for batch in batches:
        train_step(batch)
    plain = [m.state_dict() for m in (G, D)], [o.state_dict() for o in (opt_g, opt_d)]

    objects, batches, train_step = gan_fp16()
    guard = Guard(objects[0], objects[2], objects[4])
    for batch in batches:
        guard.step(train_step, batch)
    assert guard.report is None and len(guard.rechecked) >= 3
    for model, kept in zip(objects[:2], plain[0], strict=True):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    for opt, kept in zip(objects[2:4], plain[1], strict=True):
        now = opt.state_dict()["state"]
        kept_state = kept["state"].items()
        assert all(torch.equal(now[i][k], v) for i, s in kept_state for k, v in s.items())


def test_guard_step_on_a_gans_fp16_loop_names_its_bad_batch():
    (G, _, opt_g, _, scaler), batches, train_step = gan_fp16(nan_at=8)
    guard = Guard(G, opt_g, scaler)
    with pytest.raises(NonFiniteError) as caught:
        for batch in batches:
            guard.step(train_step, batch)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase) == (8, "input")


@pytest.mark.parametrize("form", ["step", "with"])
def test_an_lbfgs_loops_bad_batch_is_the_input_not_weights_broken_before_the_step(form):
    """`optimizer.step(closure)` with L-BFGS evaluates its closure several times a step,
    moving the weights in between: a NaN batch makes the first loss NaN, and L-BFGS then
    the weights. The weights the step began with were finite: phase input, not
    parameters (the `with` form had judged a later closure's loss against the weights
    L-BFGS had moved within the step). A clean run stays healthy in both forms."""

    def run(nan_at: int | None) -> Guard:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        g = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(8)
        ]
        if nan_at is not None:
            data[nan_at][0][3, 3] = float("nan")

        def train_step(batch):
            x, y = batch

            def closure():
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            optimizer.step(closure)

        guard = Guard(model, optimizer, raise_error=False)
        watching = guard if form == "with" else contextlib.nullcontext()
        with watching:
            for batch in data:
                guard.step(train_step, batch) if form == "step" else train_step(batch)
                if guard.report is not None:
                    break
        return guard

    healthy = run(None)
    assert healthy.report is None and healthy.result.steps_completed == 8
    first = run(nan_at=5).report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (5, "input", "input:0")


def test_guard_step_calls_that_accumulate_are_replayed_with_the_gradients_they_began_with():
    """A loop that steps its optimizer every 4th call of `guard.step` (each call one
    micro-batch): the gradients carry from call to call, so the replay must begin from
    the ones the snapshot's call began with, not from the failing call's NaN (which the
    rerun's update then wrote into the weights: "param:0.weight held NaN values",
    nonfinite-parameters, for finite weights). The guard says once that a call stepped
    no optimizer."""
    model, optimizer, batches, _ = tiny_loop(steps=12, nan_at=9)

    def micro_step(batch, index):
        x, y = batch
        (F.cross_entropy(model(x), y) / 4).backward()
        if index % 4 == 3:
            optimizer.step()
            optimizer.zero_grad()

    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError) as caught, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for index, batch in enumerate(batches):
            guard.step(micro_step, batch, index)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (9, "input", "input:0.0")
    assert first.reproduced == "exact"
    stepless = [w for w in said if "stepped no optimizer" in str(w.message)]
    assert len(stepless) == 1 and "step 0" in str(stepless[0].message)


def ema_distillation(lr: float):
    """A student and its EMA teacher, which the step reads (a distillation term) and
    updates after the optimizer step; float16 with a GradScaler that overflows first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    teacher = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))]
    batches *= 8

    def train_step(x, y):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            with torch.no_grad():
                soft = F.softmax(teacher(x).float(), -1)
            kl = F.kl_div(F.log_softmax(logits.float(), -1), soft, reduction="batchmean")
            loss = F.cross_entropy(logits, y) + kl
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), model.parameters(), strict=True):
                t.mul_(0.9).add_(s, alpha=0.1)

    return model, teacher, optimizer, scaler, batches, train_step


def test_an_ema_teacher_given_in_modules_is_replayed_as_the_step_read_it():
    """The teacher's state changes every step; given in `modules`, the snapshots keep it:
    the scaler's rechecks rerun the step (teacher update included) and put it back, so
    the run trains bit-identically to the unguarded one; and the replay of a failing
    step reads the teacher as the step did, naming the student's first Linear, forward
    (not given, it replayed with the teacher of after the failure and named its layer)."""
    model, teacher, optimizer, scaler, batches, train_step = ema_distillation(lr=1e-3)
    for batch in batches:
        train_step(*batch)
    plain = [m.state_dict() for m in (model, teacher)]
    model, teacher, optimizer, scaler, batches, train_step = ema_distillation(lr=1e-3)
    guard = Guard(model, optimizer, scaler, modules=[teacher])
    for batch in batches:
        guard.step(train_step, *batch)
    assert guard.report is None and guard.rechecked
    for module, kept in zip((model, teacher), plain, strict=True):
        assert all(torch.equal(module.state_dict()[k], v) for k, v in kept.items())

    model, teacher, optimizer, scaler, batches, train_step = ema_distillation(lr=1e4)
    guard = Guard(model, optimizer, scaler, modules=[teacher])
    with pytest.raises(NonFiniteError) as caught:
        for batch in batches:
            guard.step(train_step, *batch)
    first = caught.value.report.first_nonfinite
    assert (first.phase, first.module, first.op) == ("forward", "0", "aten.addmm.default")
    assert not any("did not follow the run" in n for n in caught.value.report.notes)


def test_a_replay_that_leaves_the_runs_path_says_so():
    """The EMA teacher not given: the replay reads it as it is after the failure, and
    the step it reruns on the way (step 0) no longer computes the run's loss. The report
    says so, with both losses, rather than pass off what the replay met as the run's."""
    model, _, optimizer, scaler, batches, train_step = ema_distillation(lr=1e4)
    guard = Guard(model, optimizer, scaler)
    with pytest.raises(NonFiniteError) as caught:
        for batch in batches:
            guard.step(train_step, *batch)
    (note,) = [n for n in caught.value.report.notes if "did not follow the run" in n]
    assert "step 0's loss was 1.3" in note and "replayed nan" in note and "modules=" in note


def test_a_guard_refuses_a_module_in_modules_that_is_not_one():
    model, optimizer, _, _ = tiny_loop()
    expected = r"a module in modules is a str, expected a torch\.nn\.Module"
    with pytest.raises(UsageError, match=expected):
        Guard(model, optimizer, modules=["teacher"])


def test_with_form_judges_the_gradients_of_an_iteration_whose_step_the_loop_skipped():
    """A loop that skips its optimizer step on some iterations (a loss-spike rule) and
    zeroes the gradients as each iteration begins: a skipped iteration is a micro-batch
    of the next step, and its NaN gradients (sqrt at 0 in its backward), wiped before
    that step's backward ended, still fail it (the CPU's sentinel kept only the last
    backward's sums, and said healthy; on CUDA every backward's flag counts)."""
    model, optimizer, batches, _ = tiny_loop(steps=10)

    def train_step(batch, index):
        x, y = batch
        optimizer.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x), y)
        if index == 5:
            loss = loss + torch.sqrt(loss - loss)  # NB: finite, its backward is not
        loss.backward()
        if index % 3 != 2:  # NB: iterations 2, 5 and 8 step no optimizer
            optimizer.step()

    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for index, batch in enumerate(batches):
            train_step(batch, index)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase) == (4, "backward")  # NB: iteration 5 is step 4's first


def test_a_healthy_loop_returns_its_step_results_and_closes_clean():
    model, optimizer, batches, train_step = tiny_loop()
    with Guard(model, optimizer) as guard:
        losses = guarded(guard, train_step, batches)
    assert len(losses) == len(batches) and all(torch.isfinite(x) for x in losses)
    assert guard.report is None
    assert guard.result.steps_run == len(batches)


def test_labels_missing_as_nan_and_masked_in_the_loss_keep_both_forms_healthy():
    """The rule diagnose follows: a batch's NaN that the loss selects away heals."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(4)]
    for _, y in batches:
        y[::3] = float("nan")  # missing labels

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        known = ~torch.isnan(y)
        loss = ((model(x) - y)[known] ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    with Guard(model, optimizer) as guard:
        guarded(guard, train_step, batches)
    with Guard(model, optimizer) as with_form:
        for batch in batches:
            train_step(batch)
    assert guard.report is None and with_form.report is None
    assert guard.result.steps_run == with_form.result.steps_run == len(batches)


def fp16_loop(
    steps: int = 12,
    init_scale: float = 2.0**24,
    sqrt_at_zero: bool = False,
    clip: str | None = None,
):
    """tiny_loop under float16 autocast with a GradScaler (which overflows a few times
    first at 2**24); `sqrt_at_zero` adds a term whose gradient is NaN at any scale;
    `clip` "after" or "before" `scaler.unscale_`."""
    model, optimizer, batches, _ = tiny_loop(steps=steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=False)  # in place: the recheck must put them back
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = F.cross_entropy(out, y)
        if sqrt_at_zero:
            loss = loss + torch.sqrt(((out - out.detach()).float() ** 2).sum())  # sqrt'(0)
        scaler.scale(loss).backward()
        if clip == "before":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if clip is not None:
            scaler.unscale_(optimizer)
        if clip == "after":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()

    return model, optimizer, scaler, batches, train_step


def test_weights_broken_before_a_step_the_scaler_overflows_are_still_the_parameters():
    """A weight set to NaN before step 1, while the GradScaler still searches its scale
    (2**24: steps 0 to 2 overflow). The replay, from a snapshot taken before the edit,
    begins the step with finite weights and then meets the scale's overflow in the
    backward, which the scaler would skip: another event than this failure, so the
    report stays with the weights broken before the step (it named the overflow, with
    fp16-overflow and exploding-gradients)."""
    model, optimizer, scaler, batches, train_step = fp16_loop()
    guard = Guard(model, optimizer, scaler)
    with pytest.raises(NonFiniteError) as caught:
        for step, batch in enumerate(batches):
            if step == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            guard.step(train_step, batch)
    report = caught.value.report
    first = report.first_nonfinite
    assert (first.step, first.phase, first.reproduced) == (1, "parameters", "not-reproduced")
    assert [c.id for c in report.causes] == ["nonfinite-parameters", "transient-fault"]
    assert any("something outside the steps changed them" in n for n in report.notes)


def test_scaler_skips_are_overflow_events_and_their_recheck_leaves_no_trace():
    model, optimizer, scaler, batches, train_step = fp16_loop()
    with Guard(model, optimizer, scaler) as guard:
        guarded(guard, train_step, batches)
    skips = [e for e in guard.result.events if e.kind == "scaler-skip"]
    assert guard.report is None and len(skips) >= 2
    assert [e.scale for e in skips] == [2.0**24 / 2**i for i in range(len(skips))]
    assert {e.reason for e in skips} == {"overflow"}  # each rerun at loss scale 1: finite
    for steps in (len(skips), len(batches)):  # ending on a skip, and on a clean step
        model, optimizer, scaler, batches, train_step = fp16_loop(steps)
        guarded(Guard(model, optimizer, scaler), train_step, batches)
        plain_model, *_, plain_step = fp16_loop(steps)
        for batch in batches:
            plain_step(batch)
        for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
            assert torch.equal(p, q)
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)


def test_guard_step_reruns_a_skip_unscaled_and_catches_the_nan_the_scaler_hid():
    model, optimizer, scaler, batches, train_step = fp16_loop(sqrt_at_zero=True)
    with pytest.raises(NonFiniteError) as caught:
        guarded(Guard(model, optimizer, scaler), train_step, batches)
    report = caught.value.report
    first = report.first_nonfinite
    assert (first.step, first.phase, first.reproduced) == (0, "backward", "exact")
    assert report.evidence.backward_of.startswith("torch.sqrt")
    assert report.events == [] and "loss scale 1" in " ".join(report.notes)


@pytest.mark.parametrize("form", ["with", "step"])
def test_a_clip_before_unscale_is_said_once_and_kept_for_the_report(form):
    """The hooks see the order of the calls: a clip that met gradients still carrying the
    loss scale is warned about (the loop trains, healthy, ~65536x too slowly), and kept
    for a report's clip-before-unscale."""
    model, optimizer, scaler, batches, train_step = fp16_loop(clip="before")
    guard = Guard(model, optimizer, scaler)
    hooked = guard if form == "with" else contextlib.nullcontext()
    warned = pytest.warns(UserWarning, match=r"step 0 clipped the gradients before")
    with warned as caught, hooked:
        for batch in batches:
            if form == "step":
                guard.step(train_step, batch)
            else:
                train_step(batch)
    assert len([w for w in caught if "clip" in str(w.message)]) == 1
    assert guard.run.clipped_scaled == 0 and guard.report is None


def test_a_clip_after_unscale_is_no_clip_before_it():
    model, optimizer, scaler, batches, train_step = fp16_loop(clip="after")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Guard(model, optimizer, scaler) as guard:
            for batch in batches:
                train_step(batch)
    assert guard.run.clipped_scaled is None and guard.run.clip_grad_norm == 1.0


def test_the_with_form_cannot_rerun_a_skip_so_only_a_collapse_fails():
    model, optimizer, scaler, batches, train_step = fp16_loop(
        steps=MAX_SKIP_STREAK + 2, init_scale=2.0**16, sqrt_at_zero=True
    )
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer, scaler):
        for batch in batches:
            train_step(batch)
    report = caught.value.report
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (0, "backward")
    assert [e.reason for e in report.events] == ["unchecked"] * MAX_SKIP_STREAK
    assert f"skipped {MAX_SKIP_STREAK} steps in a row" in report.summary


class Regressor(nn.Module):
    """A model called with keywords, `model(**batch)`, that computes its own loss and
    returns it beside its predictions, as transformers' models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict:
        pred = self.net(features).squeeze(-1)
        return {"loss": F.mse_loss(pred, labels), "logits": pred}


def keyword_loop(nan_at: int, steps: int = 6):
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [
        {"features": torch.randn(8, 8, generator=g), "labels": torch.randn(8, generator=g)}
        for _ in range(steps)
    ]
    batches[nan_at]["labels"][3] = float("nan")

    def train_step(batch):
        optimizer.zero_grad()
        model(**batch)["loss"].backward()
        optimizer.step()

    return model, optimizer, batches, train_step


@pytest.mark.parametrize("nan_at", [0, 3])
def test_a_nan_in_keyword_labels_is_the_input_phase(nan_at):
    model, optimizer, batches, train_step = keyword_loop(nan_at)
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for batch in batches:
            train_step(batch)  # the loop unchanged: the model's inputs are the batch
    assert (
        caught.value.report.first_nonfinite.step,
        caught.value.report.first_nonfinite.phase,
    ) == (
        nan_at,
        "input",
    )
    model, optimizer, batches, train_step = keyword_loop(nan_at)
    with pytest.raises(NonFiniteError) as caught:
        guarded(Guard(model, optimizer), train_step, batches)  # replayed: the tensor named
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor, first.value) == (
        nan_at,
        "input",
        "input:labels",
        "nan",
    )


def test_a_nan_loss_in_one_micro_batch_is_not_hidden_by_the_next():
    model, optimizer, batches, _ = tiny_loop()

    def accumulate(micro_batches, poison_first=False):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            loss = F.cross_entropy(model(x), y)
            if poison_first and i == 0:
                loss = loss * float("nan")  # outside the model: the loss phase
            (loss / len(micro_batches)).backward()
        optimizer.step()

    guard = Guard(model, optimizer)
    guard.step(accumulate, batches[:2])
    with pytest.raises(NonFiniteError) as caught:
        guard.step(accumulate, batches[2:4], poison_first=True)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.op) == (1, "loss", "aten.mul.Tensor")


def test_a_forward_that_raises_is_unwound_and_the_next_steps_are_still_watched(recwarn):
    model, optimizer, batches, train_step = tiny_loop(nan_at=4)
    wrong = (torch.randn(8, 7), batches[2][1])  # 7 features where the model takes 8
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for batch in [*batches[:2], wrong, *batches[3:]]:
            with contextlib.suppress(RuntimeError):  # the user's loop skips the batch
                train_step(batch)  # that raised, before its optimizer step
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase) == (3, "input")  # the skipped batch took no step
    assert not [w for w in recwarn if "always_call" in str(w.message)]  # our hook ran clean


def test_a_guard_step_that_raised_took_no_step_and_the_next_ones_are_still_watched():
    model, optimizer, batches, train_step = tiny_loop(nan_at=5)
    wrong = (torch.randn(8, 7), batches[2][1])  # 7 features where the model takes 8
    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError) as caught:
        for batch in [*batches[:3], wrong, *batches[3:]]:  # past the light switch
            with contextlib.suppress(RuntimeError):  # the user's loop skips the batch
                guard.step(train_step, batch)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (5, "input", "input:0")
    assert first.reproduced == "exact"
    assert not model._forward_pre_hooks and not model._forward_hooks


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("wrap", [nn.DataParallel, Holder], ids=["DataParallel", "a holder"])
def test_the_with_form_finds_the_batch_of_a_model_the_loop_calls_through_a_wrapper(wrap):
    """The guard is given the model; the loop calls a wrapper around it: the model's own
    first call is the forward, its arguments the batch."""
    model, optimizer, batches, _ = tiny_loop(nan_at=2)
    called = wrap(model)
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(called(x), y).backward()
            optimizer.step()
    report = caught.value.report
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (2, "input")
    assert report.causes[0].id == "nonfinite-input"


def test_a_guard_that_does_not_raise_lets_the_optimizer_hooks_after_its_own_run():
    """The failure is found inside the guard's optimizer hook, while torch loops over the
    global ones: the guard goes quiet there and its hooks come off when it closes."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model, optimizer, batches, train_step = tiny_loop(nan_at=3)
    guard, logged = Guard(model, optimizer, raise_error=False), []
    with guard:
        handle = register_optimizer_step_post_hook(lambda *_: logged.append(1))
        for batch in batches:
            train_step(batch)  # the loop goes on after the failure, as it decides
    handle.remove()
    assert guard.report is not None and guard.report.first_nonfinite.step == 3
    assert guard.result.steps_completed == 3 and len(logged) == len(batches)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_guard_leaves_no_hook_or_patch_behind():
    from torch.nn.modules import module as nn_module

    backward, scale = torch.autograd.backward, torch.amp.GradScaler.scale
    hooks = len(nn_module._global_forward_hooks)
    model, optimizer, batches, train_step = tiny_loop(nan_at=4)
    with pytest.raises(NonFiniteError):
        guarded(Guard(model, optimizer), train_step, batches)
    with pytest.raises(NonFiniteError), Guard(model, optimizer):
        for batch in batches:  # past the switch to the model's own (light) hooks
            train_step(batch)
    assert torch.autograd.backward is backward and torch.amp.GradScaler.scale is scale
    assert len(nn_module._global_forward_hooks) == hooks
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("form", ["with", "step"])
def test_a_guarded_model_saves_whole_and_copies_as_it_would_unguarded(form):
    """`torch.save(model)` mid-run pickled the guard's hook and everything it held
    (TypeError), and `copy.deepcopy(model)` for an EMA copied it; the guard followed the
    model through a hook on it. Now the saved model loads as the unguarded one, and the
    EMA copy is a plain copy."""
    model, optimizer, batches, train_step = tiny_loop()
    twin = copy.deepcopy(model)
    guard = Guard(model, optimizer)
    saved, emas = [], []

    def step_and_save(batch):
        loss = train_step(batch)
        buffer = io.BytesIO()
        torch.save(model, buffer)  # a script's checkpoint, as it goes
        saved.append(buffer.getvalue())
        emas.append(copy.deepcopy(model))
        return loss

    if form == "with":
        with guard:
            for batch in batches:
                step_and_save(batch)
    else:
        guarded(guard, step_and_save, batches)
    loaded = torch.load(io.BytesIO(saved[-1]), weights_only=False)
    assert vars(loaded).keys() == vars(twin).keys()
    assert not loaded._forward_pre_hooks and not loaded._forward_hooks
    assert loaded.state_dict().keys() == twin.state_dict().keys()
    twin.load_state_dict(loaded.state_dict())
    pairs = zip(twin.parameters(), model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(not e._forward_pre_hooks and not e._forward_hooks for e in emas)


FEATURES: dict[str, torch.Tensor] = {}


def clamp_input(module, args):
    """A user's own forward pre-hook (module-level: `torch.save(model)` pickles it)."""
    return (args[0].clamp(-3, 3),)


def keep_features(module, args, output):
    """A user's own forward hook: a layer's features, kept for the loss or a log."""
    FEATURES["first"] = output.detach()


def hooks_of(model: nn.Module) -> dict[str, list]:
    """Every module's hooks, their ids and kinds included: as torch keeps (and pickles) them."""
    return {
        name: [
            dict(getattr(m, table))
            for table in (
                "_forward_pre_hooks",
                "_forward_pre_hooks_with_kwargs",
                "_forward_hooks",
                "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called",
            )
        ]
        for name, m in model.named_modules()
    }


def measured_modules(guard: Guard) -> set[str]:
    """The modules whose output the forecast measured, as its values ride on the
    sentinel's read (`Sentinel.carry`)."""
    carry, seen = guard.sentinel.carry, set()

    def take():
        taken = carry()
        if taken is not None:
            seen.update(site.module for site in taken[0].peaks)
        return taken

    guard.sentinel.carry = take
    return seen


@pytest.mark.parametrize("form", ["with", "step"])
def test_with_the_forecast_on_each_module_keeps_its_own_hooks_alone_and_the_model_saves(form):
    """The forecast measured each module's output through a hook on the module: the
    model's own `torch.save(model)` raised "Can't pickle local object
    'Precursors._on_output.<locals>.hook'", an EMA made by `copy.deepcopy(model)` carried
    nandoctor's hooks, and every module with weights held a forward hook its user never
    gave it. Now the forecast still measures them, and each module, its saved copy and
    its deep copy hold the user's hooks, under the ids torch gave them, and nothing else."""
    model, optimizer, batches, _ = tiny_loop()
    model[0].register_forward_pre_hook(clamp_input)
    model[0].register_forward_hook(keep_features)
    own = hooks_of(model)
    guard = Guard(model, optimizer)  # the forecast is on by default
    measured = measured_modules(guard)
    during, saved, copies = [], [], []

    def step_save_and_copy(batch):
        x, y = batch
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y) + 1e-3 * FEATURES["first"].pow(2).mean()
        during.append(hooks_of(model))  # the forward done, the forecast listening
        loss.backward()
        optimizer.step()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        saved.append(buffer.getvalue())
        copies.append(copy.deepcopy(model))
        return loss.detach()

    if form == "with":
        with guard:
            for batch in batches:
                step_save_and_copy(batch)
    else:
        guarded(guard, step_save_and_copy, batches)
        guard.close()
    assert guard.report is None and measured == {"0", "2"}  # every module with weights
    assert all(hooks == own for hooks in during) and hooks_of(model) == own
    loaded = torch.load(io.BytesIO(saved[-1]), weights_only=False)
    assert hooks_of(loaded) == own
    assert all(hooks_of(c) == own for c in copies)


@pytest.mark.parametrize("form", ["with", "step"])
def test_a_guarded_loop_takes_no_number_from_torch_s_count_of_hook_handles(form):
    """torch numbers every hook handle from one count, and a module's hooks are kept (and
    pickled with a model saved whole) under those numbers: the guard's global hooks, and
    the forecast's each step, took numbers from it, so a hook the user registered
    during the run got another id than unguarded. The count moves as in the plain loop."""
    from torch.utils.hooks import RemovableHandle

    def handles_taken(run) -> int:
        before = RemovableHandle.next_id
        run()
        return RemovableHandle.next_id - before

    model, optimizer, batches, train_step = tiny_loop()
    plain = handles_taken(lambda: [train_step(batch) for batch in batches])
    guard = Guard(model, optimizer)
    if form == "with":

        def run():
            with guard:
                for batch in batches:
                    train_step(batch)
    else:

        def run():
            guarded(guard, train_step, batches)
            guard.close()

    assert handles_taken(run) == plain


class Compiled(nn.Module):
    """A model whose middle block is compiled alone (the regional recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        block = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.block = torch.compile(block, backend="aot_eager")
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(x)))


@pytest.mark.parametrize("compiled", ["a block", "the model"])
@pytest.mark.parametrize("form", ["with", "step"])
def test_with_the_forecast_on_torch_compile_finds_no_global_hook_of_nandoctors(
    form, compiled, recwarn
):
    """torch.compile warns ("Using `torch.compile(module)` when there are global hooks on
    modules ...") at each call of a compiled module while any global module hook exists,
    and traces the hook into its graph: the forecast's, on while the loss is computed,
    stands aside while a compiled module runs, as the guard's own do."""
    torch.manual_seed(0)
    model = Compiled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    called = torch.compile(model, backend="aot_eager") if compiled == "the model" else model
    _, _, batches, _ = tiny_loop()
    guard = Guard(model, optimizer)
    measured = measured_modules(guard)

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(called(x), y).backward()
        optimizer.step()

    if form == "with":
        with guard:
            for batch in batches:
                train_step(batch)
    else:
        guarded(guard, train_step, batches)
        guard.close()
    assert guard.report is None and guard.result.steps_completed == len(batches)
    assert not [w for w in recwarn if "global hooks" in str(w.message)]
    # a compiled module's output is measured as it returns, as any module's (the root's
    # too, in the turn its head is not); what runs inside it, never (its graph holds no hook)
    assert measured == ({"", "stem", "block", "head"} if compiled == "a block" else {""})


class Blocks(nn.Module):
    """Repeated blocks, each compiled in place (`block.compile()`: no `OptimizedModule`,
    torch compiles the block's own `_call_impl`, hooks included)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(8, 3)
        for block in self.blocks:
            block.compile(backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("form", ["with", "step"])
def test_with_the_forecast_on_blocks_compiled_in_place_compile_once_without_a_break(form):
    """The forecast's hooks on each module were traced into the blocks' compiled code,
    which torch then compiled again step after step (giving up after 8, and running them
    uncompiled). Its one global hook now returns before anything of it is traced: each
    block compiles once, with no graph break, as unguarded."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # NB: no graph of another test's in the caches
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, batches, _ = tiny_loop()
    guard = Guard(model, optimizer)
    breaks = sum(counters["graph_break"].values())

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    with torch._dynamo.config.patch(error_on_recompile=True):
        if form == "with":
            with guard:
                for batch in batches:
                    train_step(batch)
        else:
            guarded(guard, train_step, batches)
            guard.close()
    assert guard.result.steps_completed == len(batches)
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.parametrize("given", ["model", "compiled"])
@pytest.mark.parametrize("form", ["with", "step"])
def test_a_guard_follows_the_compiled_module_the_loop_calls(form, given, recwarn):
    """The loop calls `torch.compile(model)`, the guard given either: the compiled
    module's call is the forward and its arguments the batch (given the model, the guard
    warned that the step trained without calling it, and a NaN batch read as phase
    `loss`), and torch does not warn about the guard's hooks."""
    model, optimizer, batches, _ = tiny_loop(nan_at=3)
    compiled = torch.compile(model, backend="eager")

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        optimizer.step()

    guard = Guard(model if given == "model" else compiled, optimizer)
    with pytest.raises(NonFiniteError) as caught:
        if form == "with":
            with guard:
                for batch in batches:
                    train_step(batch)
        else:
            guarded(guard, train_step, batches)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase) == (3, "input")
    assert not [w for w in recwarn if "nandoctor" in str(w.message) or "hooks" in str(w.message)]


WRONG_ARGUMENTS = {
    "no optimizer": (lambda m, o: Guard(m, None), "Guard: optimizer is None, expected"),
    "swapped": (lambda m, o: Guard(o, m), "Guard: model is a SGD, expected a torch.nn.Module"),
    "a dtype for a scaler": (lambda m, o: Guard(m, o, "fp16"), "Guard: scaler is a str"),
    "a step that is no callable": (
        lambda m, o: Guard(m, o).step(5, torch.randn(2, 8)),
        "guard.step: the step is an int, expected a callable",
    ),
}


@pytest.mark.parametrize(("make", "message"), WRONG_ARGUMENTS.values(), ids=WRONG_ARGUMENTS)
def test_a_wrong_argument_is_one_line_before_any_hook_goes_on(make, message):
    from torch.nn.modules import module as nn_module

    model, optimizer, _, _ = tiny_loop()
    hooks = len(nn_module._global_forward_hooks)
    with pytest.raises(UsageError, match=message) as caught:
        make(model, optimizer)
    assert caught.value.exit_code == ExitCode.USAGE
    assert len(nn_module._global_forward_hooks) == hooks


def test_guard_and_nonfinite_error_are_exported_from_the_package():
    assert nandoctor.Guard is Guard and nandoctor.NonFiniteError is NonFiniteError


def test_the_with_form_on_gpt2_catches_a_nan_in_a_keyword_input_after_the_light_switch():
    pytest.importorskip("transformers")
    from tests.helpers.real_models import gpt2, lm_data

    torch.manual_seed(0)
    model = gpt2(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for step, batch in enumerate(lm_data(batches=6)):
            with torch.no_grad():  # the user's own features, not a forward of the step
                embeds = model.get_input_embeddings()(batch["input_ids"])
            if step == 4:
                embeds[1, 3, 0] = float("nan")
            optimizer.zero_grad()
            loss = model(inputs_embeds=embeds, labels=batch["labels"]).loss  # the library's
            loss.backward()
            optimizer.step()
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase) == (4, "input")
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_without_a_cause_the_errors_hint_says_how_to_have_the_tensor_named():
    """The `with` form cannot replay: a NaN born in the loss has no cause to hint at, and
    the hint points to `guard.step` (it was empty)."""
    model, optimizer, batches, _ = tiny_loop()
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer):
        for i, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y) * (float("nan") if i == 2 else 1.0)
            loss.backward()
            optimizer.step()
    error = caught.value
    assert error.report.causes == [] and error.hint is not None
    assert "pass each step to guard.step(fn, batch)" in error.hint


def test_with_the_tensor_named_and_no_cause_the_hint_says_where_to_look():
    """guard.step names the op and line of a NaN the user's code wrote; no rule fits a
    written NaN, and the hint was None."""
    model, optimizer, batches, _ = tiny_loop()
    guard = Guard(model, optimizer)

    def train(batch):
        x, y = batch
        optimizer.zero_grad()
        hidden = model[0](x)
        hidden[0, 0] = float("nan")  # the user's own write
        loss = F.cross_entropy(model[2](model[1](hidden)), y)
        loss.backward()
        optimizer.step()

    with pytest.raises(NonFiniteError) as caught:
        for batch in batches:
            guard.step(train, batch)
    error = caught.value
    assert error.report.causes == [] and error.report.first_nonfinite.op is not None
    assert error.hint.startswith(f"no known cause fits: {error.report.first_nonfinite.op} at ")


def test_building_a_guard_leaves_pythons_random_state_alone():
    """A user seeds, then builds the guard: the loop's `random` draws (shuffles,
    augmentations) must be those of the same script without it. Its first use imports
    rich, which draws from `random` as it is imported. A fresh process: the test's own
    may have imported rich already."""
    import subprocess
    import sys

    script = (
        "import random, torch, nandoctor\n"
        "random.seed(1234)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "guard = nandoctor.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "print(random.random() == random.Random(1234).random())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


def test_the_rate_quoted_is_the_largest_groups_at_the_failing_step():
    """A head at 20x its backbone's rate, warmed up by a scheduler: learning-rate-too-high
    quotes the rate the head's group ran the failing step with (20 * 4/10 at step 3), not
    the first group's, nor the rate the scheduler set after the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    groups = [{"params": model[0].parameters(), "lr": 1e-3}]
    optimizer = torch.optim.SGD([*groups, {"params": model[2].parameters(), "lr": 20.0}])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g) * 10, torch.randint(0, 3, (16,), generator=g))]

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        target = F.one_hot(y, 3).float() * 1e3
        F.mse_loss(model(x), target).backward()
        optimizer.step()
        schedule.step()

    guard = Guard(model, optimizer, scheduler=schedule)
    with pytest.raises(NonFiniteError) as caught:
        for _ in range(60):
            guard.step(train_step, batches[0])
    report = caught.value.report
    assert report.first_nonfinite.step == 3
    (cause,) = [c for c in report.causes if c.id == "learning-rate-too-high"]
    assert "lr=8 in effect at step 3" in cause.evidence[-1]


@pytest.mark.parametrize("recheck", [True, False])
def test_skips_are_rechecked_by_calling_fn_again_unless_asked_not_to(recheck):
    """A GradScaler starting at 2**24 skips its first steps (overflows): `guard.step`
    reruns each at loss scale 1, calling `fn` again, and says which steps it reran;
    `recheck_skips=False` calls `fn` once a step (for state the guard is not given)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    calls = []

    def train_step(batch):
        calls.append(1)
        x, y = batch
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    g = torch.Generator().manual_seed(1)
    guard = Guard(model, optimizer, scaler, recheck_skips=recheck)
    for _ in range(12):
        batch = (torch.randn(8, 8, generator=g) * 100, torch.randint(0, 3, (8,), generator=g))
        guard.step(train_step, batch)
    guard.close()
    assert guard.report is None and scaler.get_scale() < 2.0**24  # it skipped, healthily
    assert (len(calls) > 12, bool(guard.rechecked)) == (recheck, recheck)


def test_after_raising_the_gradients_are_the_failing_steps_not_the_replays():
    """A NaN written into a weight between steps: the failing step's gradients are NaN;
    the replay, which starts from a snapshot before the edit, makes finite ones. After
    the raise the loop finds its own, as it left them."""
    model, optimizer, batches, train_step = tiny_loop()
    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError):
        for i, batch in enumerate(batches):
            if i == 5:
                with torch.no_grad():
                    model[2].weight[0, 0] = float("nan")
            guard.step(train_step, batch)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert not torch.isfinite(model[2].weight.grad).all()


def test_a_collapse_the_with_form_could_not_recheck_says_what_else_it_may_be():
    """A backward 0/0 at steps 4, 7, 10, ... (loss finite): the `with` form cannot rerun
    the loop, so its skips are unchecked and only the scale's collapse fails it; the cause
    says that a NaN the scaler hid collapses the scale too, and who rechecks each skip."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NonFiniteError) as caught, Guard(model, optimizer, scaler=scaler):
        for step in range(80):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
                if step >= 4 and (step - 4) % 3 == 0:
                    loss = loss + 0.0 * torch.sqrt((logits - logits.detach()).float().pow(2).sum())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    report = caught.value.report
    (collapse,) = [c for c in report.causes if c.id == "grad-scaler-collapse"]
    assert any(
        e.startswith("its skips were not rechecked at loss scale 1 (no rerun of the loop did)")
        for e in collapse.evidence
    ), collapse.evidence


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
@pytest.mark.parametrize("form", ["step", "with"])
def test_a_grad_scaler_over_float16_parameters_raises_the_users_error_with_the_way_out(form):
    """The user's own GradScaler refuses float16 gradients: the error stays theirs (their
    frame, their type, for their `except`), and says why and what to do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def train_step(x):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x.half()).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    x = torch.randn(4, 8)
    refused = pytest.raises(ValueError, match="Attempting to unscale FP16 gradients")
    with refused as caught, Guard(model, optimizer, scaler) as guard:
        guard.step(train_step, x) if form == "step" else train_step(x)
    (note,) = caught.value.__notes__
    assert note.startswith("nandoctor: the parameters this optimizer steps are float16")
    assert "a GradScaler needs float32 master weights" in note
    assert "keep the parameters in float32" in note and "enabled=False" in note
