"""The tracer: the thorough probe, run only on the replayed bad step.

It checks every operator's output (a `TorchDispatchMode`, modes.py) in forward, loss,
backward and the optimizer update, and follows each non-finite value through the ops
(origins.py): an output inherits the origin of its non-finite inputs, and an op that made
a kind of value its inputs did not hold is a new origin. At the failure (a non-finite
loss when the loss phase ends, a non-finite gradient when backward ends, a non-finite
weight after the update) the origin of that value is the finding, with the evidence kept
at its birth: its inputs' statistics, the ops that made them (one and two levels back),
the op rerun in float32, and the library and user lines that issued it. The non-finite
values that healed before (T5's `log(0)`, an attention mask's -inf) are the transients.

Where: the module comes from forward hooks (`ModuleTracker`); in backward, from the
autograd node being run, which a `TorchFunctionMode` mapped at forward time to the module,
the user's source line and the torch function that made it. A loop that trains other root
modules (`watch` on a GAN: `others`) has their modules, weights and gradients followed
too: a module path is then the one inside the root it is in (`Sighting.root`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.overrides import resolve_name

from nandoctor.localize import ops
from nandoctor.localize.finding import Sighting, finding_of, held_rows
from nandoctor.localize.frames import call_site, user_source
from nandoctor.localize.modes import NodeInfo, NodeRecorder, OpChecker
from nandoctor.localize.modules import ModuleTracker
from nandoctor.localize.origins import Lineage, OriginTable, descend, reaching, transients
from nandoctor.localize.provenance import Provenance
from nandoctor.localize.stats import kinds_of, row_counts, tensor_stats
from nandoctor.report.evidence import Evidence
from nandoctor.report.types import Transient
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.state import TrainingObjects
from nandoctor.runtime.step_grads import StepGradients
from nandoctor.runtime.tensors import additive_mask, local, named_tensors, nonfinite

__all__ = ["Sighting", "Tracer"]

MAX_EVIDENCE = 32  # origins of each kind (accidental, deliberate) with the full evidence


class Tracer(Probe):
    def __init__(
        self, objects: TrainingObjects, *, light: bool = False, others: Sequence[nn.Module] = ()
    ) -> None:
        """`objects`: the run's model (known by now) and optimizer (read when an update
        is traced: a hooked run may meet its optimizer only in the traced step).
        `light`: no provenance, module magnitudes or float32 rerun (after running out of
        memory); the origin op, module, tensor and line are still found. `others`: the
        other root modules the step trains (a hooked run's `others`, which it may add to
        as the step meets more: followed from their next call)."""
        if objects.model is None:
            raise LookupError("no model to trace: the loop has not run its model yet")
        self.objects, self.model, self.light = objects, objects.model, light
        self.modules = ModuleTracker(self.model, quiet=self.quiet, enabled=not light, others=others)
        self._others = others
        self.origins = OriginTable()
        self.origin: Sighting | None = None  # set when the failure is reached
        self.transients: list[Transient] = []
        self.ctx: StepContext | None = None
        self._busy = False
        self._evidence_left = {True: MAX_EVIDENCE, False: MAX_EVIDENCE}  # by deliberate
        self._nodes: dict[Any, NodeInfo] = {}
        # NB: origins born since this micro-batch began, and when its INPUT phase began
        self._micro_from = self._input_from = 0
        self._step_grads = StepGradients()  # NB: a GAN's other gradients, the last step's
        self.provenance = Provenance(self._name_of)
        self._stack = contextlib.ExitStack()

    @property
    def finding(self) -> Sighting | None:
        return self.origin

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
            stack.enter_context(NodeRecorder(self))
            stack.enter_context(OpChecker(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self._nodes.clear()

    # -- phases the loop announces: the failure points -------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self.ctx = ctx
        with self.quiet():
            parameters = self._parameters()
            self._step_grads.begin(p for _, _, p in parameters)
            for root, name, p in parameters:
                shard = local(p)  # NB: sharded (FSDP): this rank's shard, by the full name
                if _has_nonfinite(shard):
                    owner = name.rpartition(".")[0]
                    found = finding_of(Phase.PARAMETERS, owner, None, f"param:{name}", shard, None)
                    self.origin = replace(found, root=root)
                    return

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.INPUT:
            self._input_from = len(self.origins.born)
        elif phase is Phase.FORWARD and len(self._others) >= len(self.modules.roots):
            self.modules.track(self._others)  # NB: a root module first met in this step

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.BACKWARD:  # NB: the next micro-batch, if any, begins
            self._micro_from = len(self.origins.born)
        if self.origin is not None:
            return
        with self.quiet():
            if phase is Phase.INPUT:
                self._input_checked(ctx)
            elif phase is Phase.LOSS and ctx.loss is not None:
                self._reach(phase, [("output", ctx.loss, 0)])
            elif phase is Phase.BACKWARD:
                made = self._step_grads.made
                self._reach(phase, [(f"grad:{n}", made(p), r) for r, n, p in self._parameters()])
            elif phase is Phase.OPTIMIZER:
                self._reach(phase, [(f"param:{n}", p, r) for r, n, p in self._parameters()])

    def _name_of(self, t: torch.Tensor) -> str | None:
        """`buffer norm.eps` or `parameter norm.eps` for a tensor of the roots' own."""
        for top in self.modules.roots:
            for kind, named in (("buffer", top.named_buffers), ("parameter", top.named_parameters)):
                name = next((n for n, b in named() if local(b) is t or b is t), None)
                if name is not None:
                    return f"{kind} {name}"
        return None

    def _parameters(self) -> list[tuple[int, str, nn.Parameter]]:
        """Each root's parameters, by their names inside it (a shared one: its first)."""
        seen: set[int] = set()
        out = []
        for root, top in enumerate(self.modules.roots):
            for name, p in top.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((root, name, p))
        return out

    def step_aborted(self, ctx: StepContext) -> None:
        """The step raised and the run is over (a loss that raises on NaN): the first
        accidental non-finite value the step made (its batch's, an op's) is as far as it
        went, so it is the origin."""
        if self.origin is None:
            first = next((o for o in self.origins.born if not o.deliberate), None)
            self.origin = first.finding if first is not None else None
        self._one_micro_batch(ctx)

    def step_ended(self, ctx: StepContext) -> None:
        if self.origin is None:  # nothing reached a failure: every non-finite value healed
            self.transients = transients(self.origins.born, frozenset())
        self._one_micro_batch(ctx)

    def _one_micro_batch(self, ctx: StepContext) -> None:
        """The step is over. NB: a followed loop numbers its micro-batches as they come
        (`StepHooks`): a step that had one is not gradient accumulation, and its origin
        has no micro-batch."""
        if self.origin is not None and not ctx.micro_batch and self.origin.micro_batch == 0:
            self.origin = replace(self.origin, micro_batch=None)
        self.ctx = None

    def _input_checked(self, ctx: StepContext) -> None:
        """A non-finite batch tensor is an origin like any op's output: it is the failure's
        origin only if its values reach the failure (labels missing as NaN, masked in the
        loss, heal: a transient). NB: a batch announced after ops of its micro-batch
        already met its values (`watch` meets a model called by keyword at its first
        call's end; a hooked loop that moves its batch before calling the model) cannot be
        followed: then, as a tracer without lineages would, the batch is the origin. Ops
        inside the INPUT phase (the copy to the device) are the batch's own."""
        late = self._input_from > self._micro_from
        if not late:  # NB: what the copy to the device made non-finite, the batch held
            self.origins.unborn(self._input_from)
        for path, t in named_tensors(ctx.batch):
            if _has_nonfinite(t):
                tensor = f"input:{path or 'batch'}"
                found = self._stamped(finding_of(Phase.INPUT, None, None, tensor, t, None))
                found = replace(found, samples=held_rows(t, ctx.batch))
                if late:
                    self.origin = found
                    return
                self.origins.mark(t, self.origins.birth(found, ctx.step, additive_mask(t), []))

    def _reach(self, phase: Phase, named: list[tuple[str, torch.Tensor | None, int]]) -> None:
        """If any of these values (a role, the tensor, the root it belongs to) is
        non-finite, the failure is reached: report the origin its lineage names (the
        earliest, when several reach it)."""
        present = [(role, local(t), r) for role, t, r in named if t is not None]  # FSDP: shards
        if not present or not bool(nonfinite([t for _, t, _ in present], present[0][1].device)):
            return
        bad = [(role, t, r) for role, t, r in present if _has_nonfinite(t)]
        known = [x for _, t, _ in bad if (x := self.origins.lineage(t)) is not None]
        if known:
            lineage = reaching(known)
            origin = lineage.origin
            if origin.deliberate:
                # NB: a value no op of ours made non-finite, in a step whose batch was: the
                # batch's values, through an op the tracer does not see (a sparse batch's
                # to_dense), not a mask buffer
                batch = (o for o in self.origins.born if o.finding.phase is Phase.INPUT)
                origin = next(batch, origin)
            self.origin = origin.finding
            reached = lineage.ancestors | {origin.seq}
            self.transients = transients(self.origins.born, reached, origin.finding)
            return
        # NB: made where no op of ours saw it: the first accidental origin (if any), as
        # a tracer without lineages would say, or the tensor itself
        # NB: a batch's NaN comes last: born before any op, it would always be "first"
        accidental = [o for o in self.origins.born if not o.deliberate]
        first = min(accidental, key=lambda o: o.finding.phase is Phase.INPUT, default=None)
        if first is None:
            role, t, root = bad[0]
            owner = _owner(role) if ":" in role and role != "output" else None
            found = finding_of(phase, owner, None, role, t, None)
            self.origin = self._stamped(replace(found, root=root))
        else:
            self.origin = first.finding
        reached = frozenset() if first is None else frozenset({first.seq})
        self.transients = transients(self.origins.born, reached, self.origin)

    # -- called by the modes ---------------------------------------------------------
    def watching(self) -> bool:
        return self.origin is None and self.ctx is not None and not self._busy

    def where(self) -> tuple[Phase, str | None, str | None, NodeInfo | None]:
        phase = self.ctx.phase if self.ctx and self.ctx.phase else Phase.LOSS
        node = torch._C._current_autograd_node()
        info = self._nodes.get(node) if node is not None else None
        if info is not None:
            return Phase.BACKWARD, info.module, info.source, info
        if phase in (Phase.FORWARD, Phase.LOSS):
            return phase, self.modules.current, user_source(), None
        return phase, None, user_source(), None

    def record_made(self, func: Any, args: tuple, kwargs: dict, out: list, where: tuple) -> None:
        if not self.light:
            self.provenance.record(func, args, kwargs, out, where)

    def examine(
        self, func: Any, args: tuple, kwargs: dict, bad: list, before: dict, where: tuple
    ) -> None:
        """An op made a non-finite output: it inherits its inputs' lineage, or it is a
        new origin (then its evidence is kept now, while its inputs still exist)."""
        named = dict(ops.named_tensors(func, args, kwargs))
        fresh = [n for n in named if n not in before]
        kinds = dict(zip(fresh, kinds_of([named[n] for n in fresh]), strict=True)) | before
        parents = [x for n, t in named.items() if any(kinds[n]) and (x := self.origins.lineage(t))]
        if not parents:  # a collective's result landing where it was awaited
            parents = [x for _, t in bad if (x := self.origins.arrived(t)) is not None]
        if any(map(_from_batch_mask, parents)):
            parents = self._masks_as_data(func, named, kinds, parents)
        inherits = any(not p.origin.deliberate for p in parents)  # then nothing else matters
        created = not inherits and _created(ops.scalar_nonfinite(args, kwargs), kinds, bad)
        lineage = descend(parents, created)
        if lineage is None:
            finding = self._born(func, args, kwargs, bad, before, where, created)
            step = self.ctx.step if self.ctx else -1
            lineage = self.origins.birth(finding, step, not created, parents)
        for _, t in bad:
            self.origins.mark(t, lineage)

    # -- internals -------------------------------------------------------------------
    def _masks_as_data(
        self, func: Any, named: dict, kinds: dict, parents: list[Lineage]
    ) -> list[Lineage]:
        """A batch tensor taken for a mask (`additive_mask`: 0 and -inf only) that a matrix
        product or a convolution multiplies through, into a non-finite output, is data
        (`log` of a 0/1 feature): its origin is accidental from here on. A mask is added
        to scores, never multiplied."""
        factors = [named[n] for n in named if any(kinds[n]) and ops.multiplies(func, n)]
        data = {
            x.origin.seq for t in factors if (x := self.origins.lineage(t)) and _from_batch_mask(x)
        }
        return [
            Lineage(self.origins.as_data(p.origin), p.ancestors) if p.origin.seq in data else p
            for p in parents
        ]

    def _born(self, func, args, kwargs, bad, before, where, created) -> Sighting:
        phase, module, source, info = where
        index, tensor = bad[0]
        role, root = self._role(phase, tensor)
        if phase is Phase.OPTIMIZER and ":" in role:
            module = _owner(role)
        elif info is not None or module is not None:
            root = info.root if info is not None else self.modules.current_root
        frames = info.frames if info is not None else call_site()[1]
        found = finding_of(phase, module, ops.op_name(func), role, tensor, source, created, frames)
        full = not self.light and self._evidence_left[not created] > 0
        self._evidence_left[not created] -= 1
        evidence = Evidence(
            inputs=[
                tensor_stats(n, t)
                for n, t in ops.named_tensors(func, args, kwargs)
                if n not in before
            ],
            output=found.evidence.output,
            scalars=ops.scalars_text(func, args, kwargs),
            backward_of=f"{info.function} ({_node_name()})" if info else None,
            producers=self.provenance.producers(func, args, kwargs) if full else [],
            recompute=ops.recompute_float32(func, args, kwargs, index) if full else None,
        )
        rows = row_counts(tensor) if full and phase in (Phase.FORWARD, Phase.LOSS) else ()
        return self._stamped(replace(found, evidence=evidence, root=root, rows=rows))

    def _stamped(self, found: Sighting) -> Sighting:
        """The finding, with the micro-batch under way (gradient accumulation)."""
        micro = self.ctx.micro_batch if self.ctx is not None else None
        return found if micro is None else replace(found, micro_batch=micro)

    def _role(self, phase: Phase, t: torch.Tensor) -> tuple[str, int]:
        """The tensor's role, and the root whose parameter it is (0 when none's)."""
        if phase in (Phase.FORWARD, Phase.LOSS):
            return "output", 0
        optimizer = self.objects.optimizer
        state = optimizer.state if optimizer is not None else {}
        for root, name, p in self._parameters():
            if t is p:
                return f"param:{name}", root
            if t is p.grad:
                return f"grad:{name}", root
            for key, value in state.get(p, {}).items():
                if t is value:
                    return f"state:{name}.{key}", root
        return ("grad_input" if phase is Phase.BACKWARD else "output"), 0

    def note_node(self, node: Any, function: Any) -> None:
        """Map a new autograd node (and the unnamed ones behind it) to where it was made."""
        if node is None or node in self._nodes:
            return
        source, frames = call_site()
        name = resolve_name(function) or getattr(function, "__qualname__", str(function))
        info = NodeInfo(self.modules.current, source, name, frames, self.modules.current_root)
        todo = [node]
        while todo:
            n = todo.pop()
            if n is None or n in self._nodes or type(n).__name__ == "AccumulateGrad":
                continue
            self._nodes[n] = info
            todo.extend(fn for fn, _ in n.next_functions)


def _created(scalars: tuple[bool, bool], kinds: dict, bad: list) -> bool:
    """Did the op make a kind of value none of its inputs held (NaN from no NaN, inf from
    no inf)? A NaN or inf among plain-number arguments counts as held: `fill(-inf)`."""
    in_nan = scalars[0] or any(nan for nan, _ in kinds.values())
    in_inf = scalars[1] or any(inf for _, inf in kinds.values())
    outs = kinds_of([t for _, t in bad])
    return any((nan and not in_nan) or (inf and not in_inf) for nan, inf in outs)


def _owner(role: str) -> str:
    """The module that owns `param:<name>`, `grad:<name>` or `state:<name>.<key>`."""
    kind, _, name = role.partition(":")
    if kind == "state":
        name = name.rpartition(".")[0]
    return name.rpartition(".")[0]


def _node_name() -> str:
    node = torch._C._current_autograd_node()
    return node.name() if node is not None else "?"


def _from_batch_mask(lineage: Lineage) -> bool:
    """Descends from a batch tensor taken for a mask (0 and -inf only)."""
    return lineage.origin.deliberate and lineage.origin.finding.phase is Phase.INPUT


def _has_nonfinite(t: torch.Tensor) -> bool:
    """NaN or inf in `t`, of any kind (float64, complex, sparse; a meta tensor has none)."""
    return not t.is_meta and bool(nonfinite([t], t.device))
