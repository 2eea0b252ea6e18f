"""The tracer's two modes: every aten op checked (dispatch), every autograd node mapped
to where its forward ran (torch functions).

`OpChecker` sorts each op before looking at its values:
- memory an op allocated and left unwritten (`empty_like`, `new_empty`) is not a value:
  never checked, and what an in-place op later overwrites there held nothing;
- a view (`view`, `t`, `expand`, `detach`) shows its base's values: it carries the
  base's lineage, unchecked (one host read saved per view);
- any other op's outputs (or the tensors an in-place op writes) are checked, one host
  read per op; a non-finite one goes to `Tracer.examine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nandoctor.localize import ops
from nandoctor.localize.origins import reaching
from nandoctor.localize.stats import kinds_of
from nandoctor.report.types import Frame
from nandoctor.runtime import wrappers

if TYPE_CHECKING:
    from nandoctor.localize.tracer import Tracer


@dataclass(frozen=True)
class NodeInfo:
    """Where the forward of an autograd node ran."""

    module: str | None
    source: str | None
    function: str
    frames: list[Frame] = field(default_factory=list)
    root: int = 0  # the root module `module` is inside (`ModuleTracker.current_root`)


def _unusual(args: tuple, kwargs: dict) -> bool:
    """An op on sparse or meta tensors: run, not checked (its values are not strided
    memory the checks can read; the phase checks still see what it produced)."""
    leaves = [*pytree.tree_leaves(args), *pytree.tree_leaves(kwargs)]
    return any(
        isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_meta) for t in leaves
    )


class OpChecker(TorchDispatchMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.tracer.watching() or _unusual(args, kwargs):
            return func(*args, **kwargs)
        if ops.leaves_unwritten(func):
            out = func(*args, **kwargs)
            self._allocated(func, args, kwargs, ops.output_tensors(out))
            return out
        written = ops.written_tensors(func, args, kwargs)
        before = self._before(func, written)  # their values are about to go
        out = func(*args, **kwargs)
        if ops.is_view(func):
            self._viewed(func, args, kwargs, ops.output_tensors(out))
        elif ops.is_collective(func):
            self._exchanged(func, args, kwargs, ops.collective_outputs(out))
        else:
            self._checked(func, args, kwargs, out, written, before)
        return out

    def _exchanged(self, func: Any, args: tuple, kwargs: dict, outs: list) -> None:
        """What a collective writes descends from what this rank sent, even where no
        value is bad yet: the values may arrive after it returned (FSDP's reduce-scatter
        output, read later by the copy into the gradient shard).

        NB: its outputs are not checked here. The work may still be writing them (even a
        synchronous call waits after the op returns), so what a check read would depend on
        timing; and an origin born here would rerun the op for its evidence, a collective
        this rank alone would then issue, leaving the others waiting for it (a job that
        hangs). The op that first reads the landed values is checked as any other."""
        tracer = self.tracer
        tracer.record_made(func, args, kwargs, outs, tracer.where())
        origins = tracer.origins
        for t in outs:
            origins.written(t)
        targets = {id(t) for t in outs}
        sent = [
            x
            for _, t in ops.named_tensors(func, args, kwargs)
            if id(t) not in targets and (x := origins.lineage(t)) is not None
        ]
        if sent:
            lineage = reaching(sent)
            for t in outs:
                origins.expect(t, lineage)

    def _allocated(self, func: Any, args: tuple, kwargs: dict, outs: list) -> None:
        self.tracer.record_made(func, args, kwargs, outs, self.tracer.where())
        for t in outs:
            self.tracer.origins.allocated(t)

    def _viewed(self, func: Any, args: tuple, kwargs: dict, outs: list) -> None:
        self.tracer.record_made(func, args, kwargs, outs, self.tracer.where())
        base = next((t for _, t in ops.named_tensors(func, args, kwargs)), None)
        if base is not None:
            self.tracer.origins.share(base, outs)

    def _before(self, func: Any, written: list) -> dict[str, tuple[bool, bool]]:
        """(NaN, inf) of what an in-place op reads before writing; nothing where the
        memory was never written, or where the op overwrites without reading."""
        origins = self.tracer.origins
        read = [(n, t) for n, t in written if not (ops.overwrites(func, n) or origins.unwritten(t))]
        kinds = dict.fromkeys((n for n, _ in written), (False, False))
        kinds.update(zip((n for n, _ in read), kinds_of([t for _, t in read]), strict=True))
        return kinds

    def _checked(self, func, args, kwargs, out, written, before) -> None:
        tracer = self.tracer
        outputs = [t for _, t in written] or ops.output_tensors(out)
        where = tracer.where()
        tracer.record_made(func, args, kwargs, outputs, where)
        for _, t in written:
            tracer.origins.written(t)
        floats = [(i, t) for i, t in enumerate(outputs) if t.is_floating_point() or t.is_complex()]
        if not floats:
            return
        flags = torch.stack([~torch.isfinite(t).all() for _, t in floats]).tolist()
        bad = [pair for pair, flag in zip(floats, flags, strict=True) if flag]
        if written:  # an in-place op that made its target finite again: it healed
            for (_, t), flag in zip(floats, flags, strict=True):
                if not flag:
                    tracer.origins.forget(t)
        if bad:
            with tracer.quiet():
                tracer.examine(func, args, kwargs, bad, before, where)


class NodeRecorder(TorchFunctionMode):
    """Notes where each autograd node was made: the torch function whose output it is,
    and a custom `torch.autograd.Function`'s `apply`, which function modes never see (its
    node was otherwise taken for the next op's: Bloom's GeLU backward for the Linear's;
    `wrappers.observe_applies`)."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __enter__(self) -> NodeRecorder:
        super().__enter__()
        wrappers.observe_applies(self)
        return self

    def __exit__(self, *exc: object) -> None:
        wrappers.stop_observing_applies(self)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._note(out, func)
        return out

    def applied(self, cls: type, out: Any) -> None:
        self._note(out, cls)

    def _note(self, out: Any, made_by: Any) -> None:
        if self.tracer.watching():
            for t in ops.output_tensors(out, shards=False):  # the autograd nodes are theirs
                self.tracer.note_node(t.grad_fn, made_by)
