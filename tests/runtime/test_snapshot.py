"""Snapshots: restoring one and replaying gives bit-identical steps (dropout, Adam state,
scheduler and loss scale included), whatever the snapshot policy."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.probe import Phase, Probe
from nandoctor.runtime.rerun import SessionSteps
from nandoctor.runtime.snapshot import (
    AUTO_MAX_EVERY,
    AUTO_MIN_EVERY,
    SnapshotStore,
    StateSnapshot,
    state_bytes,
)
from nandoctor.runtime.step import run_step
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

DROPOUT_PY = """
import torch
from torch import nn
from train import build_data


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))


class Mixed(nn.Module):
    # tensors of three dtypes to keep: float32 weights and BatchNorm statistics, a float64
    # head, BatchNorm's int64 count of batches

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 3).double()

    def forward(self, x):
        return self.head(self.body(x).double()).float()


def mutating_loss(model, batch):
    x, y = batch
    x.mul_(2.0)  # a user loss that scales its batch in place
    return nn.functional.cross_entropy(model(x), y)
"""


class Losses(Probe):
    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}

    def phase_ended(self, ctx, phase):
        if phase is Phase.LOSS:
            self.seen.setdefault(ctx.step, []).append(ctx.loss.item())


def session_of(project, tmp_path, model="dropout.py:build_model", **overrides):
    config = base_config(
        model=model,
        optimizer={"name": "Adam", "lr": 1e-2},
        scheduler={"name": "StepLR", "step_size": 2, "gamma": 0.5},
        precision={"dtype": "fp16"},
        **overrides,
    )
    path = project(config)
    (tmp_path / "dropout.py").write_text(DROPOUT_PY)
    return build_session(load_config(path))


def run(session, store, probe, steps):
    for step, batch in itertools.islice(session.batches, steps):
        store.before_step(step, batch)
        run_step(session, step, batch, probe)


@pytest.mark.parametrize("every", [1, 3, None])
def test_replaying_from_a_snapshot_is_bit_identical(project, tmp_path, every):
    session = session_of(project, tmp_path)
    store, probe = SnapshotStore(session, every=every), Losses()
    run(session, store, probe, 10)
    weights = {k: v.clone() for k, v in session.model.state_dict().items()}
    lr, scale = session.optimizer.param_groups[0]["lr"], session.scaler.get_scale()

    for step, batch in store.rewind_to(9):
        run_step(session, step, batch, probe)

    assert probe.seen[9][0] == probe.seen[9][1]
    assert all(torch.equal(weights[k], v) for k, v in session.model.state_dict().items())
    assert session.optimizer.param_groups[0]["lr"] == lr
    assert session.scaler.get_scale() == scale


def test_auto_policy_keeps_a_few_steps_of_reach_for_small_states(project, tmp_path):
    session = session_of(project, tmp_path)
    store = SnapshotStore(session)
    run(session, store, Probe(), AUTO_MIN_EVERY + 4)
    assert store.every == AUTO_MIN_EVERY  # a small model: the shortest period
    last = AUTO_MIN_EVERY + 3
    assert [s for s, _ in store.rewind_to(last)] == list(range(AUTO_MIN_EVERY, last + 1))
    assert store.rewind_to(AUTO_MIN_EVERY - 1)[0][0] == 0  # the older snapshot reaches back


def test_auto_policy_bounds_the_batches_it_keeps_beside_a_large_state(
    project, tmp_path, monkeypatch
):
    """A large state spaces the snapshots out, but never so far that the batches kept
    since the older one (two periods' worth) outgrow the budget: an image model's batches
    are as large as its state, and K = 64 kept 128 of them (never below AUTO_MIN_EVERY, though)."""
    import nandoctor.runtime.snapshot as snapshot

    monkeypatch.setattr(snapshot, "AUTO_BYTES_PER_STEP", 1)  # the state counts as large

    def period_with(budget: int) -> int:
        monkeypatch.setattr(snapshot, "AUTO_BATCH_BUDGET", budget)
        session = session_of(project, tmp_path)
        store = SnapshotStore(session)
        run(session, store, Probe(), 2)  # the period is set once Adam has its state
        return store.every

    _, first = next(iter(session_of(project, tmp_path).batches))
    batch = sum(t.numel() * t.element_size() for t in first)
    assert period_with(2**30) == AUTO_MAX_EVERY  # the state's size alone decides
    assert period_with(2 * batch * 40) == 40  # 80 batches kept at most
    assert period_with(1) == AUTO_MIN_EVERY  # never below (the state's size is the budget)


def test_a_snapshot_keeps_tensors_of_every_dtype_and_restores_them_bit_identical(project, tmp_path):
    session = session_of(project, tmp_path, model="dropout.py:Mixed")
    store, probe = SnapshotStore(session, every=4), Losses()
    run(session, store, probe, 6)
    state = {k: v.clone() for k, v in session.model.state_dict().items()}
    assert {v.dtype for v in state.values()} == {torch.float32, torch.float64, torch.int64}

    for step, batch in store.rewind_to(5):
        run_step(session, step, batch, probe)

    assert probe.seen[5][0] == probe.seen[5][1]
    assert all(torch.equal(state[k], v) for k, v in session.model.state_dict().items())


def test_a_snapshots_buffers_are_one_block_per_dtype_made_once(project, tmp_path):
    """The state is copied into a block of host memory per dtype, made at the first capture
    that needs it and reused by the captures after (not a buffer per tensor, each in the
    heap among the step's own allocations: see `_host_block`)."""
    session = session_of(project, tmp_path, model="dropout.py:Mixed")
    snapshot = StateSnapshot()

    def blocks() -> set[int]:
        return {t.untyped_storage().data_ptr() for t in snapshot.model.values()}

    snapshot.capture(session, 0)
    first = blocks()
    assert len(first) == 3  # float32, float64 and int64 tensors, 8 of them
    run(session, SnapshotStore(session, every=100), Probe(), 2)
    snapshot.capture(session, 2)
    assert blocks() == first  # the same buffers, holding step 2's state now
    assert all(
        torch.equal(kept, now) for kept, now in zip(
            snapshot.model.values(), session.model.state_dict().values(), strict=True
        )
    )  # fmt: skip


def test_a_parameter_the_optimizer_trains_outside_the_model_is_kept_and_restored():
    """A learnable temperature in the loss: the optimizer's, not the model's state dict's."""
    torch.manual_seed(0)
    model, temperature = nn.Linear(4, 2), nn.Parameter(torch.tensor(0.5))
    optimizer = torch.optim.Adam([*model.parameters(), temperature], lr=0.1)
    run = HookedRun(model=model)
    run.note_optimizer(optimizer)
    store = SnapshotStore(run, every=1)
    store.before_step(0, (torch.randn(2, 4),))
    weight = model.weight.detach().clone()
    with torch.no_grad():
        temperature.fill_(float("nan"))
        model.weight.add_(1.0)
    store.rewind_to(0)
    assert temperature.item() == 0.5 and torch.equal(model.weight, weight)


def test_a_followed_gans_second_model_and_optimizer_are_kept_and_restored():
    """A loop's other root module and its optimizer (a GAN's discriminator), met as the
    loop ran: a rewind puts them back too, weights, buffers and the optimizer's state,
    or a replay (a recheck of every GradScaler skip) would leave them trained twice. An
    optimizer met after the capture stays as it is."""
    torch.manual_seed(0)
    G, D = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 1), nn.BatchNorm1d(1))
    opt_g, opt_d = torch.optim.Adam(G.parameters(), 0.1), torch.optim.Adam(D.parameters(), 0.1)
    run = HookedRun(model=G, others=[D])
    run.note_optimizer(opt_g)
    run.note_optimizer(opt_d)

    def train() -> None:
        for opt, loss in ((opt_d, D(G(torch.randn(8, 4)).detach()).mean()), (opt_g, None)):
            opt.zero_grad()
            (loss if loss is not None else -D(G(torch.randn(8, 4))).mean()).backward()
            opt.step()

    train()  # NB: the optimizers' state exists
    store = SnapshotStore(run, every=1)
    store.before_step(1, (torch.randn(8, 4),))
    kept = {k: v.clone() for k, v in D.state_dict().items()}
    kept_avg = opt_d.state[D[0].weight]["exp_avg"].clone()
    late = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    run.note_optimizer(late)
    train()
    assert not torch.equal(D.state_dict()["1.running_mean"], kept["1.running_mean"])
    store.rewind_to(1)
    assert all(torch.equal(D.state_dict()[k], v) for k, v in kept.items())
    assert torch.equal(opt_d.state[D[0].weight]["exp_avg"], kept_avg)


def test_a_restore_gives_the_step_the_gradients_it_began_with():
    """Gradients kept with the state (they carried into the step) come back as they
    were; otherwise the step began with none, and gradients found at the restore (a
    later step's) are dropped, not added to by the replay."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = HookedRun(model=model)
    run.note_optimizer(optimizer)
    model(torch.randn(3, 4)).sum().backward()
    carried = model.weight.grad.clone()
    with_grads, without = SnapshotStore(run, every=1), SnapshotStore(run, every=1)
    with_grads.before_step(0, (torch.randn(3, 4),), grads=True)
    without.before_step(0, (torch.randn(3, 4),))
    model.weight.grad.fill_(float("nan"))
    with_grads.rewind_to(0)
    assert torch.equal(model.weight.grad, carried)
    without.rewind_to(0)
    assert model.weight.grad is None and model.bias.grad is None


def test_a_batch_modified_in_place_by_the_loss_is_kept_as_it_came(project, tmp_path):
    session = session_of(project, tmp_path, loss="dropout.py:mutating_loss")
    store, probe = SnapshotStore(session), Losses()
    run(session, store, probe, 3)
    for step, batch in store.rewind_to(2):
        run_step(session, step, batch, probe)
    assert probe.seen[2][0] == probe.seen[2][1]


def test_batches_laid_out_alike_are_kept_in_the_buffers_of_those_no_longer_kept(project, tmp_path):
    """Every batch the run saw is kept as it came, in the buffers of one the store has
    dropped: five batches' worth of buffers (2K+1 at `every: 2`) over twelve steps."""
    session = session_of(project, tmp_path, loss="dropout.py:mutating_loss")
    store, buffers = SnapshotStore(session, every=2), set()
    for step, batch in itertools.islice(session.batches, 12):
        came = [t.clone() for t in batch]
        store.before_step(step, batch)
        run_step(session, step, batch, Probe())  # the loss doubles its batch in place
        kept = store.batch_at(step)[1]
        assert all(torch.equal(k, c) for k, c in zip(kept, came, strict=True))
        buffers |= {t.data_ptr() for t in kept}
    assert len(buffers) == 5 * 2  # five (x, y) batches


def test_a_pinned_snapshot_outlives_the_ring(project, tmp_path):
    session = session_of(project, tmp_path)
    store, probe = SnapshotStore(session, every=1), Losses()
    run(session, store, probe, 3)
    store.pin(2)
    for step, batch in itertools.islice(session.batches, 5):  # steps 0..4 again, numbered on
        store.before_step(step + 3, batch)
        run_step(session, step + 3, batch, probe)
    assert [s for s, _ in store.rewind_to(2)] == [2]
    store.unpin()
    with pytest.raises(LookupError):
        store.rewind_to(2)


def test_memory_is_two_states_plus_the_batches(project, tmp_path):
    """Two snapshots, the batches since the older one (2 at `every: 1`), and the copy of
    the batch dropped last, whose buffers the next step's copy reuses."""
    session = session_of(project, tmp_path)
    store = SnapshotStore(session, every=1)
    run(session, store, Probe(), 6)
    batch_bytes = sum(t.numel() * t.element_size() for t in session.batches.build()[0])
    assert store.nbytes <= 2 * state_bytes(session) + 3 * batch_bytes


def test_every_replay_of_a_step_sees_its_batch_as_the_run_did(project, tmp_path):
    session = session_of(project, tmp_path, loss="dropout.py:mutating_loss")
    store, probe = SnapshotStore(session), Losses()
    run(session, store, probe, 3)
    for _ in range(2):  # a recheck, then the localisation's replay: one kept batch, twice
        for step, batch in store.rewind_to(2):
            SessionSteps(session).run(step, batch, probe)
    assert probe.seen[2][0] == probe.seen[2][1] == probe.seen[2][2]


def test_an_optimizer_without_state_is_snapshotted_every_k_steps_too(project, tmp_path):
    """SGD without momentum never has a state to size the period by: the shortest one,
    not a snapshot every step (a capture and RNG states each step, on the fast path)."""
    session = build_session(load_config(project(base_config(steps=40))))
    assert session.optimizer.defaults["momentum"] == 0
    store = SnapshotStore(session)
    run(session, store, Probe(), AUTO_MIN_EVERY + 4)
    assert not session.optimizer.state
    last = AUTO_MIN_EVERY + 3
    assert [s for s, _ in store.rewind_to(last)] == list(range(AUTO_MIN_EVERY, last + 1))
    assert store.rewind_to(AUTO_MIN_EVERY - 1)[0][0] == 0
