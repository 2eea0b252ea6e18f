"""The batches are the user's: `diagnose` meets a corrupt item at the step the user's own
loop meets it, written the way people write it (seed, build the model, build the loader,
then `for epoch: for batch in loader`), whether the loader shuffles from its own
generator or from the global RNG that dropout also draws from, across epochs, with
worker processes, and from a generator function."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.runtime.fast_run import fast_run, snapshot_store
from nandoctor.runtime.probe import Probe, StepContext
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

# A user's train.py, and the plain loop they run it with.
TRAIN = """
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Items(Dataset):
    '''Labelled vectors; item `bad` is corrupt (NaN), when there is one.'''

    def __init__(self, size=36, bad=None):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.randint(0, 4, (size,), generator=g)
        if bad is not None:
            self.x[bad] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))


def build_loader(own_generator=False, workers=0, bad=None, size=36):
    g = torch.Generator().manual_seed(1234) if own_generator else None
    return DataLoader(
        Items(size, bad), batch_size=8, shuffle=True, drop_last=True, generator=g,
        num_workers=workers,
    )


def noisy_batches(batches=6, rate=0.08):
    '''A generator of batches drawn from the global RNG, as synthetic data often is; a
    batch is corrupt where a draw says so.'''
    for _ in range(batches):
        x = torch.randn(8, 8)
        if torch.rand(()) < rate:
            x[3, 1] = float("nan")
        yield x, torch.randint(0, 4, (8,)), None


def loss(model, batch):
    x, y, _ = batch
    return F.cross_entropy(model(x), y)


def plain_loop(data, steps=200, **data_args):
    '''The user's own loop: the step its loss first goes NaN, and every step's items.'''
    random.seed(0)
    torch.manual_seed(0)
    model = build_model()
    build = {"loader": build_loader, "noisy": noisy_batches}[data]
    loader = build(**data_args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    step, seen = 0, []
    for epoch in range(1000):
        for batch in (loader if data == "loader" else (build(**data_args) if epoch else loader)):
            value = loss(model, batch)
            seen.append(batch[2].tolist() if batch[2] is not None else None)
            if not torch.isfinite(value) or step + 1 == steps:
                return (step if not torch.isfinite(value) else None), seen
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
            step += 1
"""


@pytest.fixture
def user(project, tmp_path):
    """`(config path, the user's module)` for data args; the module is the same file
    the config names, imported as the user's script would be."""

    def make(data: str = "train.py:build_loader", **data_args):
        path = project(
            base_config(
                model="train.py:build_model",
                data=data,
                data_args=data_args,
                loss="train.py:loss",
                optimizer={"name": "SGD", "lr": 0.05},
                steps=200,
            ),
            code=TRAIN,
        )
        spec = importlib.util.spec_from_file_location("plain_train", tmp_path / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["plain_train"] = module  # NB: worker processes find its classes
        spec.loader.exec_module(module)
        return path, module

    yield make
    sys.modules.pop("plain_train", None)


def reported_step(path) -> int | None:
    report = diagnose(load_config(path), DiagnoseOptions(verify=False))
    first = report.first_nonfinite
    return first.step if first is not None else None


def first_met_after_epoch_0(module, **data_args) -> int:
    """An item the user's loop does not meet in its first epoch (drop_last leaves it
    out): where it is first met depends on how the second epoch shuffles."""
    _, seen = module.plain_loop("loader", steps=40, **data_args)
    first_epoch = {i for items in seen[:4] for i in items}
    later = [i for items in seen[4:] for i in items if i not in first_epoch]
    return later[0]


def test_a_loader_with_its_own_generator_meets_the_corrupt_item_where_the_users_loop_does(user):
    path, module = user(own_generator=True, bad=20)
    expected, _ = module.plain_loop("loader", own_generator=True, bad=20)
    assert expected is not None
    assert reported_step(path) == expected


def test_a_global_rng_shuffle_follows_the_users_loop_across_epochs(user):
    """Each epoch's order is drawn from the global RNG when the epoch begins, after the
    previous epoch's dropout drew from it: the report's step is the user's step."""
    _, module = user()
    bad = first_met_after_epoch_0(module)
    path, _ = user(bad=bad)
    expected, _ = module.plain_loop("loader", bad=bad)
    assert expected is not None and expected >= 4  # past the first epoch
    assert reported_step(path) == expected


def test_worker_processes_shuffle_as_the_users_loop_does(user):
    _, module = user(workers=2)
    bad = first_met_after_epoch_0(module, workers=2)
    path, _ = user(workers=2, bad=bad)
    expected, _ = module.plain_loop("loader", workers=2, bad=bad)
    assert expected is not None
    assert reported_step(path) == expected


def test_a_generator_function_draws_its_batches_as_the_users_loop_does(user):
    path, module = user(data="train.py:noisy_batches")
    expected, _ = module.plain_loop("noisy")
    assert expected is not None and expected >= 6  # a later epoch's batch
    assert reported_step(path) == expected


class Items(Probe):
    """Records the dataset items of each step's batch, as the step runs."""

    forward_phase = False

    def __init__(self) -> None:
        self.seen: dict[int, list[int]] = {}

    def step_started(self, ctx: StepContext) -> None:
        self.seen[ctx.step] = ctx.batch[2].tolist()


def test_a_run_resumed_from_a_snapshot_draws_the_batches_the_run_drew(user):
    """A what-if replay resumes from a snapshot in a fresh session: the steps after it
    meet the items the run met there, the next epochs shuffled as the run shuffled them
    (the epoch's start drew from the global RNG as training had left it)."""
    path, _ = user()
    loaded = load_config(path)
    session = build_session(loaded)
    store = snapshot_store(session)
    store.every = 5
    run = Items()
    fast_run(session, 23, store=store, probe=run)
    snapshot = store.resume_point(22)
    assert snapshot is not None and snapshot.step == 20
    fresh = build_session(loaded)
    snapshot.restore(fresh)
    resumed = Items()
    fast_run(fresh, 12, probe=resumed, batches=fresh.batches.resumed(snapshot.data))
    assert list(resumed.seen) == list(range(20, 32))  # 4 batches an epoch: 2 epochs begin
    first_run = Items()
    fast_run(build_session(loaded), 32, probe=first_run)
    assert resumed.seen == {s: first_run.seen[s] for s in range(20, 32)}


def test_a_replay_draws_each_step_from_the_rng_the_run_had_there(user, project, tmp_path):
    """Between two steps the run drew the next batch from the global RNG that dropout
    draws from (a generator's `torch.randn`; a DataLoader beginning an epoch draws its
    shuffle and its workers' seed alike); the replay, from kept batches, does not draw
    them again, and runs each step from the RNG as the run had it there: its losses are
    the run's."""
    _, module = user(data="train.py:noisy_batches")
    rates = (0.08, 0.015, 0.005)  # the first NaN at steps 8, 110 and 125
    firsts = {rate: module.plain_loop("noisy", rate=rate)[0] for rate in rates}
    rate = next(r for r, step in firsts.items() if step is not None and step >= 8 and step % 8 >= 3)
    path = project(
        base_config(
            model="train.py:build_model",
            data="train.py:noisy_batches",
            data_args={"rate": rate},
            loss="train.py:loss",
            optimizer={"name": "SGD", "lr": 0.05},
            steps=200,
            snapshot={"every": 8},
        ),
        code=TRAIN,
    )
    report = diagnose(load_config(path), DiagnoseOptions(verify=False))
    assert report.first_nonfinite.step == firsts[rate]
    assert report.evidence.replayed_from_step == firsts[rate] // 8 * 8  # 3 steps or more
    assert not [n for n in report.notes if "did not follow" in n], report.notes
