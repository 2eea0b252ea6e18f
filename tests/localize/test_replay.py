"""Localisation, one failing phase at a time, on small real models: the replayed bad step
names the step, phase, module, op, tensor and the user's source line. The expected line
is found independently, by the marker comment on it."""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.localize import ops
from nandoctor.localize.replay import localize
from nandoctor.localize.tracer import Tracer
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.rerun import SessionSteps
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import TRAIN_PY, base_config

NO_VERIFY = DiagnoseOptions(verify=False)

MODELS = '''
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(OrderedDict(proj=nn.Linear(8, 8), big=nn.Linear(8, 3)))
        with torch.no_grad():
            self.encoder.big.weight.fill_(900.0)

    def forward(self, x):
        return self.encoder(x)  # marker:encoder


class Gated(nn.Module):
    """A gate whose weight starts at exactly zero: sqrt(0) is fine, its derivative is not."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x * (1 + torch.sqrt(self.weight.pow(2).sum()))  # marker:sqrt


class RootOfSquares(torch.autograd.Function):
    """sqrt(sum(w^2)) by hand, as a model's custom Function (Bloom's GeLU is one): its
    backward divides by the root, 0 at w = 0."""

    @staticmethod
    def forward(ctx, w):
        root = w.pow(2).sum().sqrt()
        ctx.save_for_backward(w, root)
        return root

    @staticmethod
    def backward(ctx, grad):
        w, root = ctx.saved_tensors
        return grad * w / root


class CustomGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x * (1 + RootOfSquares.apply(self.weight))  # marker:custom


class WithCustomGate(nn.Module):
    """The custom Function's output meets a Linear next: its backward is not the Linear's."""

    def __init__(self):
        super().__init__()
        self.gate = CustomGate()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.gate(x))


class WithGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)
        self.norm = Gated()

    def forward(self, x):
        return self.norm(self.body(x))


CALLS = {"n": 0}


class Flaky(nn.Module):
    """Goes NaN on its third call only: a replay cannot meet it again."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)

    def forward(self, x):
        CALLS["n"] += 1
        out = self.body(x)
        return out * float("nan") if CALLS["n"] == 3 else out


class Scratch(nn.Module):
    """Writes its output into a scratch buffer grown with `resize_`: memory no op wrote
    since (it still holds the NaN of the tensor that used it before) until `copy_`."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)

    def forward(self, x):
        y = self.body(x)
        scratch = torch.full((y.numel(),), float("nan"), dtype=y.dtype)
        scratch.resize_(0)
        scratch.resize_(y.shape)  # marker:resize
        return scratch.copy_(y)


class Bucketed(nn.Module):
    """T5's pattern: a log of positions that include 0, the -inf selected away by where."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)

    def forward(self, x):
        positions = torch.arange(3, dtype=x.dtype)
        buckets = torch.where(positions > 0, torch.log(positions), 0.0)  # marker:buckets
        return self.body(x) + buckets


class FlakyBucketed(Bucketed):
    """Heals a log(0) every step, and goes NaN on its third call only."""

    def forward(self, x):
        CALLS["n"] += 1
        out = super().forward(x)
        return out * float("nan") if CALLS["n"] == 3 else out


class Saturated(nn.Module):
    """exp overflows where a where discards it: the forward is finite, its backward
    multiplies the discarded inf by a zero gradient."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 3)

    def forward(self, x):
        h = self.body(x) * 100
        e = torch.exp(h)  # marker:exp
        return torch.where(h < 50, e, 0.0)


def nothing_to_average_loss(model, batch):
    x, _ = batch
    ignored = torch.full((x.shape[0],), -100)  # every target masked out
    return F.cross_entropy(model(x), ignored)  # marker:ce


def scaled_data(batches=4, scale_at=2, factor=100.0):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        x = torch.rand(8, 8, generator=g)
        out.append((x * factor if i == scale_at else x, torch.randint(0, 3, (8,), generator=g)))
    return out


def sharp_log_softmax_loss(model, batch):
    x, y = batch
    p = torch.softmax(model(x) * 100, -1)
    return -(F.one_hot(y, 3) * torch.log(p)).sum(-1).mean()  # marker:log
'''


@pytest.fixture
def models(tmp_path):
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "train.py").write_text(TRAIN_PY)
    return tmp_path


def line_of(marker: str) -> int:
    """The independent check: the line that carries the marker comment."""
    for number, line in enumerate(MODELS.splitlines(), start=1):
        if re.search(rf"# marker:{marker}\b", line):
            return number
    raise AssertionError(marker)


def report_of(project, **overrides):
    return diagnose(load_config(project(base_config(**overrides))), NO_VERIFY)


def test_input_nan_at_step_k(project, models):
    first = report_of(project, data_args={"nan_at": 3}, steps=8).first_nonfinite
    assert (first.step, first.phase, first.tensor, first.module, first.op) == (
        3,
        "input",
        "input:0",
        None,
        None,
    )
    assert (first.value, first.count_nonfinite, first.dtype, first.shape) == (
        "nan",
        1,
        "float32",
        [8, 8],
    )
    assert first.reproduced == "exact"


def test_a_named_linear_overflowing_float16_in_forward(project, models):
    report = report_of(
        project,
        model="models.py:Encoder",
        data="models.py:scaled_data",
        precision={"dtype": "fp16"},
        optimizer={"name": "SGD", "lr": 0.0},
    )
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (2, "forward", "encoder.big")
    assert first.op == "aten.addmm.default" and first.dtype == "float16"
    assert first.value in ("inf", "-inf", "mixed")  # overflow, to either side
    assert first.source == f"{models / 'models.py'}:{line_of('encoder')}"
    assert report.evidence.recompute.finite is True  # float32 holds it: a precision problem
    assert report.evidence.recompute.absmax > 65504
    assert report.evidence.modules[0].module in ("encoder.big", "encoder", "")


def test_log_of_a_softmax_that_underflowed_in_the_loss(project, models):
    report = report_of(
        project, loss="models.py:sharp_log_softmax_loss", precision={"dtype": "fp16"}
    )
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module, first.op) == (
        0,
        "loss",
        None,
        "aten.log.default",
    )
    assert first.value == "-inf" and first.source == f"{models / 'models.py'}:{line_of('log')}"
    (log_input,) = report.evidence.inputs
    assert log_input.zeros == first.count_nonfinite > 0
    producer = report.evidence.producers[0]
    assert (producer.op, producer.depth, producer.feeds) == ("aten._softmax.default", 1, "self")


def test_sqrt_at_zero_in_backward_while_the_loss_stays_finite(project, models):
    report = report_of(project, model="models.py:WithGate")
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "backward", "norm")
    assert first.op == "aten.div.Tensor" and first.tensor == "grad_input"
    assert first.source == f"{models / 'models.py'}:{line_of('sqrt')}"
    assert report.evidence.backward_of == "torch.sqrt (SqrtBackward0)"
    assert report.telemetry.loss[-1] == report.telemetry.loss[-1]  # the loss itself is finite


def test_a_custom_autograd_functions_backward_is_its_own_in_its_module(project, models):
    """PyTorch's function modes never see `Function.apply`: its backward was taken for
    the next op's (the Linear's, in the Linear's module)."""
    report = report_of(project, model="models.py:WithCustomGate")
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "backward", "gate")
    assert first.source == f"{models / 'models.py'}:{line_of('custom')}"
    assert report.evidence.backward_of == "RootOfSquares (RootOfSquaresBackward)"


def test_an_optimizer_update_that_turns_a_parameter_nonfinite(project, models):
    adam = {"name": "Adam", "lr": 1e-3, "eps": 0.0}
    first = report_of(project, optimizer=adam, data_args={"zero_feature": True}).first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "optimizer", "0")
    assert first.tensor == "param:0.weight" and first.value == "nan"
    assert first.op in ("aten.addcdiv_.default", "aten._foreach_addcdiv_.ScalarList")
    assert first.source is None  # torch's own optimizer code, no line of the user's


def test_a_checkpoint_with_a_nan_parameter(project, models, tmp_path):
    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    state = namespace["build_model"]().state_dict()
    state["2.weight"][0, 3] = float("nan")
    torch.save(state, tmp_path / "bad.pt")
    first = report_of(project, checkpoint="bad.pt").first_nonfinite
    assert (first.step, first.phase, first.module, first.op) == (0, "parameters", "2", None)
    assert (first.tensor, first.value, first.count_nonfinite) == ("param:2.weight", "nan", 1)


def test_a_nondeterministic_failure_is_reported_as_not_reproduced(project, models):
    report = report_of(project, model="models.py:Flaky")
    first = report.first_nonfinite
    # the run's phase, and a replay that met nothing
    assert (first.step, first.phase, first.reproduced) == (2, "loss", "not-reproduced")
    assert first.op is None
    assert any("nondeterministic or transient" in note for note in report.notes)


def test_the_tracer_leaves_no_hook_mode_or_changed_weight(project, models):
    session = build_session(load_config(project(base_config(data_args={"nan_at": 2}))))
    store = SnapshotStore(session)
    for step, batch in itertools.islice(session.batches, 3):
        store.before_step(step, batch)
        run_step(session, step, batch, Probe())
    weights = {k: v.clone() for k, v in session.model.state_dict().items()}
    optimizer_state = repr(session.optimizer.state_dict())
    rng = torch.get_rng_state()
    apply = torch.autograd.Function.__dict__["apply"]

    assert localize(session, store, 2, SessionSteps(session)).found

    for k, v in session.model.state_dict().items():  # NaN after the bad step: equal_nan
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0, equal_nan=True)
    assert repr(session.optimizer.state_dict()) == optimizer_state
    assert torch.equal(torch.get_rng_state(), rng)
    for module in session.model.modules():
        assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks)
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert not torch.overrides._get_current_function_mode_stack()
    assert torch.autograd.Function.__dict__["apply"] is apply  # noted while tracing only


def test_running_out_of_memory_in_the_full_trace_falls_back_to_a_lighter_one(project, monkeypatch):
    import nandoctor.localize.replay as localize_module
    from nandoctor.localize.tracer import Tracer

    class Hungry(Tracer):
        def __enter__(self):
            if not self.light:
                raise MemoryError("the full trace does not fit")
            return super().__enter__()

    monkeypatch.setattr(localize_module, "Tracer", Hungry)
    report = report_of(project, data_args={"nan_at": 2})
    assert report.first_nonfinite.reproduced == "exact"
    assert report.first_nonfinite.tensor == "input:0"
    assert any("lighter one" in note for note in report.notes)


def test_running_out_of_memory_inside_the_users_loss_falls_back_too(project, models, monkeypatch):
    """The full trace's bookkeeping runs inside the user's ops, where an out-of-memory
    error reaches the replay wrapped as the user's own error: it still means "lighter"."""
    import nandoctor.localize.replay as localize_module
    from nandoctor.localize.tracer import Tracer

    class Hungry(Tracer):
        def record_made(self, *args, **kwargs):
            if not self.light:
                raise MemoryError("the full trace does not fit")
            return super().record_made(*args, **kwargs)

    monkeypatch.setattr(localize_module, "Tracer", Hungry)
    report = report_of(
        project, loss="models.py:sharp_log_softmax_loss", precision={"dtype": "fp16"}
    )
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op, first.reproduced) == (
        0,
        "loss",
        "aten.log.default",
        "exact",
    )
    assert any("lighter one" in note for note in report.notes)


def test_an_interrupt_during_the_replay_still_gives_a_report(project, monkeypatch):
    import nandoctor.diagnose.engine as diagnose_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(diagnose_module, "localize", interrupted)
    report = report_of(project, data_args={"nan_at": 2})
    assert report.status == "interrupted" and report.first_nonfinite.step == 2
    assert any("interrupted during the instrumented replay" in note for note in report.notes)


def test_memory_an_op_left_unwritten_is_never_a_value(project, models):
    report = report_of(
        project,
        model="models.py:Scratch",
        loss="models.py:sharp_log_softmax_loss",
        precision={"dtype": "fp16"},
    )
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (0, "loss", "aten.log.default")
    assert first.source == f"{models / 'models.py'}:{line_of('log')}"
    assert not any("resize" in (t.op or "") for t in report.transients)


ALLOCATING = (
    "empty.memory_format",
    "empty_like.default",
    "new_empty.default",
    "empty_strided.default",
)


@pytest.mark.parametrize("op", ALLOCATING)
def test_the_allocating_ops_are_known_to_leave_memory_unwritten(op):
    packet, _, overload = op.partition(".")
    assert ops.leaves_unwritten(getattr(getattr(torch.ops.aten, packet), overload))


@pytest.mark.parametrize(
    ("op", "arg", "factor"),
    [
        ("addmm.default", "mat1", True),
        ("addmm.default", "self", False),  # the term added to the product (a bias, a mask)
        ("baddbmm.default", "batch2", True),
        ("baddbmm.default", "self", False),
        ("mm.default", "self", True),
        ("linear.default", "input", True),
        ("linear.default", "bias", False),
        ("convolution.default", "bias", False),
        ("add.Tensor", "other", False),  # not a product at all
    ],
)
def test_a_factor_of_a_product_is_told_from_a_term_added_to_it(op, arg, factor):
    packet, _, overload = op.partition(".")
    assert ops.multiplies(getattr(getattr(torch.ops.aten, packet), overload), arg) is factor


def test_a_value_selected_away_by_where_is_a_transient_not_the_origin(project, models):
    report = report_of(
        project,
        model="models.py:Bucketed",
        loss="models.py:sharp_log_softmax_loss",
        precision={"dtype": "fp16"},
    )
    first = report.first_nonfinite
    assert (first.phase, first.module, first.op) == ("loss", None, "aten.log.default")
    assert first.source == f"{models / 'models.py'}:{line_of('log')}"
    (healed,) = report.transients
    assert (healed.step, healed.phase, healed.module) == (first.step, "forward", "")
    assert (healed.op, healed.value) == ("aten.log.default", "-inf")
    assert healed.source == f"{models / 'models.py'}:{line_of('buckets')}"


def test_a_gradient_inherits_the_origin_of_the_forward_value_it_was_computed_from(project, models):
    report = report_of(project, model="models.py:Saturated")
    first = report.first_nonfinite
    assert report.telemetry.loss[-1] == report.telemetry.loss[-1]  # the loss stays finite
    assert (first.phase, first.module, first.op) == ("forward", "", "aten.exp.default")
    assert (first.value, first.source) == ("inf", f"{models / 'models.py'}:{line_of('exp')}")
    assert report.transients == []  # the inf reached the gradients: it did not heal


def test_an_op_inside_a_library_shows_the_library_line_and_the_users(project, models):
    report = report_of(project, loss="models.py:nothing_to_average_loss")
    first = report.first_nonfinite
    assert (first.phase, first.op) == ("loss", "aten.nll_loss_forward.default")
    library, user = first.frames
    assert library.file == "torch/nn/functional.py" and not library.user
    assert (user.file, user.line, user.user) == (str(models / "models.py"), line_of("ce"), True)
    assert first.source == f"{user.file}:{user.line}"


def test_a_replay_where_every_nonfinite_value_healed_blames_none_of_them(project, models):
    report = report_of(project, model="models.py:FlakyBucketed")
    first = report.first_nonfinite
    assert (first.step, first.reproduced, first.op) == (2, "not-reproduced", None)
    assert [(t.op, t.module) for t in report.transients] == [("aten.log.default", "")]
    assert any("saw no non-finite value reach the loss" in note for note in report.notes)


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone: its collectives complete at once."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class SeenCollectives(TorchDispatchMode):
    """Under the tracer's modes: each collective the process really issues."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated")
def test_a_collective_runs_once_under_the_tracer_and_is_judged_where_its_values_land(
    world_of_one,
):
    # A collective's output may still be landing when the op returns (FSDP's
    # reduce-scatter on the rank that inherits a NaN): judged there, the finding would
    # depend on timing, and the float32 rerun of an origin born there would issue a
    # collective the other ranks never join, so the job would hang.
    objects = SimpleNamespace(model=nn.Linear(2, 2), optimizer=None)
    tracer = Tracer(objects)
    tracer.ctx = StepContext(objects, 0, None, phases=[Phase.FORWARD])
    sent, received = torch.full((4,), float("nan")), torch.zeros(4)  # NaN from elsewhere
    with SeenCollectives() as seen, tracer:
        dist.all_gather_into_tensor(received, sent)  # one op returning its output
        received + 1
    assert seen.ops == ["c10d._allgather_base_.default"]
    assert [o.finding.op for o in tracer.origins.born] == ["aten.add.Tensor"]
    all_gather = torch.ops.c10d._allgather_base_.default  # nor is one rerun for evidence
    assert ops.recompute_float32(all_gather, (received, sent), {}) is None


def test_a_random_op_is_not_rerun_for_evidence():
    # a rerun would draw another mask than the run did, and move the generator: every
    # later random op of the replayed step would then differ from the run's
    dropout = torch.ops.aten.native_dropout.default
    before = torch.get_rng_state()
    assert (
        ops.recompute_float32(dropout, (torch.full((8,), 1e4, dtype=torch.half), 0.5, True), {})
        is None
    )
    assert torch.equal(torch.get_rng_state(), before)


def test_fsdps_copy_into_its_all_gather_buffer_leaves_the_other_ranks_part_unwritten():
    # FSDP2 copies this rank's shard into its part of the all-gather buffer; the other
    # ranks' part holds whatever the memory held (another step's NaN) until the
    # all-gather lands: no value, so no origin, nor a transient that changes run to run
    import torch.distributed.fsdp  # registers FSDP2's ops

    objects = SimpleNamespace(model=nn.Linear(2, 2), optimizer=None)
    tracer = Tracer(objects)
    tracer.ctx = StepContext(objects, 0, None, phases=[Phase.FORWARD])
    shard, buffer = torch.ones(3), torch.full((6,), float("nan"))  # rank 0 of 2
    with tracer:
        torch.ops.fsdp.all_gather_copy_in([shard], buffer, [3], 3, 0)
    assert tracer.origins.born == []
    assert buffer[:3].tolist() == [1.0, 1.0, 1.0]  # it still ran: its part is written


def test_the_batchs_copy_to_the_device_is_the_batch_not_an_origin_of_its_own():
    # on CUDA, INPUT copies the batch to the device: an op whose NaN output no op of ours
    # made. The batch is the origin of what it carries; the copy is neither an origin nor
    # a transient (here a clone on the CPU stands for that copy)
    objects = SimpleNamespace(model=nn.Linear(2, 1), optimizer=None)
    tracer = Tracer(objects)
    host = torch.tensor([[1.0, float("nan")]])
    ctx = StepContext(objects, 0, (host,))
    with tracer:
        tracer.step_started(ctx)
        ctx.phases.append(Phase.INPUT)
        tracer.phase_started(ctx, Phase.INPUT)
        ctx.batch = (host.clone(),)  # the copy to the device
        tracer.phase_ended(ctx, Phase.INPUT)
        ctx.phases[-1] = Phase.LOSS
        ctx.loss = objects.model(ctx.batch[0]).sum()
        tracer.phase_ended(ctx, Phase.LOSS)
    assert (tracer.finding.phase, tracer.finding.tensor) == (Phase.INPUT, "input:0")
    assert [o.finding.op for o in tracer.origins.born] == [None]  # the batch alone
    assert tracer.transients == []


def _replayed(project, **overrides):
    """Step 14's batch holds a NaN; snapshots every 4 steps (the newest reaching step 13
    is step 12, the oldest kept step 8): the replay of step 14, after the fast run."""
    config = base_config(steps=16, data_args={"batches": 16, "nan_at": 14}, **overrides)
    session = build_session(load_config(project(config)))
    store = SnapshotStore(session, every=4)
    for step, batch in itertools.islice(session.batches, 15):
        store.before_step(step, batch)
        run_step(session, step, batch, Probe())
    return localize(session, store, 14, SessionSteps(session))


def test_the_replay_starts_at_the_newest_snapshot_before_the_bad_step(project):
    located = _replayed(project)
    assert located.from_step == 12  # two steps re-run, not six from the oldest snapshot
    assert located.finding.evidence.update.step == 13  # the update just before the failure


def test_a_replay_looks_further_back_when_no_step_since_the_snapshot_moved_the_weights(project):
    """From step 10 the learning rate is 0: steps 12 and 13 move nothing, so the last
    update that did, step 9's, is measured from the oldest kept snapshot."""
    zero_from_10 = {"name": "MultiStepLR", "milestones": [10], "gamma": 0.0}
    located = _replayed(project, scheduler=zero_from_10)
    assert located.from_step == 8
    assert located.finding.evidence.update.step == 9
