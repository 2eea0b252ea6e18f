"""The tracer: the thorough probe, run only on the replayed bad step.

It checks every operator's output (a `TorchDispatchMode`), in forward, loss, backward
and the optimizer update, and keeps the first one that *created* a non-finite value:
a NaN from inputs without NaN, or an inf from inputs without inf. An inf that was put
there on purpose (`masked_fill(mask, -inf)`, a scalar argument) and merely carried along
is not an origin; if nothing else is found, the first non-finite output of any kind is
reported instead. For that op it keeps the evidence: its inputs' statistics, the ops that
made them (one and two levels back), and the op rerun in float32.

Where: the module comes from forward hooks (`ModuleTracker`); in backward, from the
autograd node being run, which a `TorchFunctionMode` mapped at forward time to the module,
the user's source line and the torch function that made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.localize import ops
from nandoctor.localize.modules import ModuleTracker
from nandoctor.localize.stats import nonfinite_kinds, tensor_stats, value_kind
from nandoctor.report.evidence import Evidence, Producer
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.state import TrainingObjects


@dataclass(frozen=True)
class Finding:
    """The first non-finite value of the replayed step (SPEC's `first_nonfinite`)."""

    phase: Phase
    module: str | None
    op: str | None
    tensor: str
    value: str
    dtype: str
    shape: list[int]
    count: int
    source: str | None
    evidence: Evidence = field(default_factory=Evidence)
    created: bool = True  # False: only carried an inf that was already there


@dataclass(frozen=True)
class _Made:
    """Who made a tensor (for the producers of the origin op's inputs)."""

    op: str
    module: str | None
    source: str | None
    phase: str
    inputs: tuple[tuple[str, _Made | None], ...]
    scalars: tuple[str, ...]


@dataclass(frozen=True)
class _NodeInfo:
    module: str | None
    source: str | None
    function: str


class Tracer(Probe):
    def __init__(self, objects: TrainingObjects, *, light: bool = False) -> None:
        """`objects`: the run's model (known by now) and optimizer (read when an update
        is traced: a hooked run may meet its optimizer only in the traced step).
        `light`: no provenance, module magnitudes or float32 rerun (after running out of
        memory); the origin op, module, tensor and line are still found."""
        if objects.model is None:
            raise LookupError("no model to trace: the loop has not run its model yet")
        self.objects, self.model, self.light = objects, objects.model, light
        self.modules = ModuleTracker(self.model, quiet=self.quiet, enabled=not light)
        self.origin: Finding | None = None
        self.fallback: Finding | None = None
        self.ctx: StepContext | None = None
        self._busy = False
        self._nodes: dict[Any, _NodeInfo] = {}
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._stack = contextlib.ExitStack()

    @property
    def finding(self) -> Finding | None:
        return self.origin or self.fallback

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Our own measurements run through the modes too: do not trace them."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def __enter__(self) -> Tracer:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.modules)
            stack.enter_context(_NodeRecorder(self))
            stack.enter_context(_OpChecker(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._nodes.clear()

    # -- phases the loop announces -------------------------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self.ctx = ctx
        with self.quiet():
            for name, p in self.model.named_parameters():
                if not bool(torch.isfinite(p).all()):
                    owner = name.rpartition(".")[0]
                    self.origin = self._found(
                        Phase.PARAMETERS, owner, None, f"param:{name}", p, None
                    )
                    return

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.INPUT and self.origin is None:
            with self.quiet():
                for path, t in _leaves(ctx.batch, ""):
                    if (t.is_floating_point() or t.is_complex()) and not bool(
                        torch.isfinite(t).all()
                    ):
                        self.origin = self._found(Phase.INPUT, None, None, f"input:{path}", t, None)
                        return

    def step_ended(self, ctx: StepContext) -> None:
        self.ctx = None

    # -- called by the modes -------------------------------------------------------
    def watching(self) -> bool:
        return self.origin is None and self.ctx is not None and not self._busy

    def where(self) -> tuple[Phase, str | None, str | None, _NodeInfo | None]:
        phase = self.ctx.phase if self.ctx and self.ctx.phase else Phase.LOSS
        node = torch._C._current_autograd_node()
        info = self._nodes.get(node) if node is not None else None
        if info is not None:
            return Phase.BACKWARD, info.module, info.source, info
        if phase in (Phase.FORWARD, Phase.LOSS):
            return phase, self.modules.current, ops.user_source(), None
        return phase, None, ops.user_source(), None

    def record_made(self, func: Any, args: tuple, kwargs: dict, out: list, where: tuple) -> None:
        if self.light:
            return
        phase, module, source, _ = where
        inputs = tuple((n, self._made.get(t)) for n, t in ops.named_tensors(func, args, kwargs))
        scalars = tuple(ops.scalars_text(func, args, kwargs))
        made = _Made(ops.op_name(func), module, source, phase.value, inputs, scalars)
        for t in out:
            self._made[t] = made

    def examine(
        self, func: Any, args: tuple, kwargs: dict, bad: list, before: dict, where: tuple
    ) -> None:
        """An op produced a non-finite value: is it the origin, or carried along?"""
        phase, module, source, info = where
        in_nan, in_inf = ops.scalar_nonfinite(args, kwargs)
        for name, t in ops.named_tensors(func, args, kwargs):
            nan, inf = before.get(name) or nonfinite_kinds(t)
            in_nan, in_inf = in_nan or nan, in_inf or inf
        index, tensor = bad[0]
        out_nan, out_inf = nonfinite_kinds(tensor)
        created = (out_nan and not in_nan) or (out_inf and not in_inf)
        if not created and self.fallback is not None:
            return
        role = self._role(phase, tensor)
        if phase is Phase.OPTIMIZER and ":" in role:
            module = _owner(role)
        finding = self._found(phase, module, ops.op_name(func), role, tensor, source, created)
        evidence = Evidence(
            inputs=[
                tensor_stats(n, t)
                for n, t in ops.named_tensors(func, args, kwargs)
                if n not in before
            ],
            output=finding.evidence.output,
            scalars=ops.scalars_text(func, args, kwargs),
            backward_of=f"{info.function} ({_node_name()})" if info else None,
            producers=[] if self.light else self._producers(func, args, kwargs),
            recompute=None if self.light else ops.recompute_float32(func, args, kwargs, index),
        )
        self._keep(replace(finding, evidence=evidence), created)

    # -- internals -----------------------------------------------------------------
    def _found(self, phase, module, op, role, tensor, source, created=True) -> Finding:
        stats = tensor_stats(role, tensor)
        finding = Finding(
            phase=phase,
            module=module,
            op=op,
            tensor=role,
            value=value_kind(stats),
            dtype=stats.dtype,
            shape=stats.shape,
            count=stats.nonfinite,
            source=source,
            evidence=Evidence(output=stats),
            created=created,
        )
        return finding

    def _keep(self, finding: Finding, created: bool) -> None:
        if created:
            self.origin = finding
        elif self.fallback is None:
            self.fallback = finding

    def _role(self, phase: Phase, t: torch.Tensor) -> str:
        if phase in (Phase.FORWARD, Phase.LOSS):
            return "output"
        optimizer = self.objects.optimizer
        state = optimizer.state if optimizer is not None else {}
        for name, p in self.model.named_parameters():
            if t is p:
                return f"param:{name}"
            if t is p.grad:
                return f"grad:{name}"
            for key, value in state.get(p, {}).items():
                if t is value:
                    return f"state:{name}.{key}"
        return "grad_input" if phase is Phase.BACKWARD else "output"

    def _producers(self, func: Any, args: tuple, kwargs: dict) -> list[Producer]:
        out: list[Producer] = []
        for name, t in ops.named_tensors(func, args, kwargs):
            made = self._made.get(t)
            if made is None:
                continue
            out.append(_producer(made, 1, name))
            out.extend(_producer(m, 2, n) for n, m in made.inputs if m is not None)
        return out

    def note_node(self, node: Any, function: Any) -> None:
        """Map a new autograd node (and the unnamed ones behind it) to where it was made."""
        if node is None or node in self._nodes:
            return
        info = _NodeInfo(
            self.modules.current, ops.user_source(), resolve_name(function) or str(function)
        )
        todo = [node]
        while todo:
            n = todo.pop()
            if n is None or n in self._nodes or type(n).__name__ == "AccumulateGrad":
                continue
            self._nodes[n] = info
            todo.extend(fn for fn, _ in n.next_functions)


class _OpChecker(TorchDispatchMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if not tracer.watching():
            return func(*args, **kwargs)
        written = ops.written_tensors(func, args, kwargs)
        before = {n: nonfinite_kinds(t) for n, t in written}  # their values are about to go
        out = func(*args, **kwargs)
        outputs = [(i, t) for i, (_, t) in enumerate(written)] or list(
            enumerate(ops.output_tensors(out))
        )
        floats = [(i, t) for i, t in outputs if t.is_floating_point()]
        where = tracer.where()
        tracer.record_made(func, args, kwargs, [t for _, t in outputs], where)
        if floats:
            flags = torch.stack([~torch.isfinite(t).all() for _, t in floats]).tolist()
            bad = [pair for pair, flag in zip(floats, flags, strict=True) if flag]
            if bad:
                with tracer.quiet():
                    tracer.examine(func, args, kwargs, bad, before, where)
        return out


class _NodeRecorder(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tracer.watching():
            for t in ops.output_tensors(out):
                self.tracer.note_node(t.grad_fn, func)
        return out


def _producer(made: _Made, depth: int, feeds: str) -> Producer:
    return Producer(made.op, made.module, made.source, made.phase, depth, feeds, list(made.scalars))


def _owner(role: str) -> str:
    """The module that owns `param:<name>` or `state:<name>.<key>`."""
    kind, _, name = role.partition(":")
    if kind == "state":
        name = name.rpartition(".")[0]
    return name.rpartition(".")[0]


def _node_name() -> str:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else "?"


def _leaves(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a batch with their paths: `0`, `x`, `0.input_ids`."""
    if isinstance(obj, torch.Tensor):
        yield path or "batch", obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}.{i}" if path else str(i))
