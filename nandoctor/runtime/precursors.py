"""Precursors: the forecast's signals, measured on the device every step and read with the
sentinel's one read.

Per step, without a host read of its own:

- each module's largest |output| (one `aminmax` a call of a module with weights of its own
  or modules inside: not an activation's, a dropout's; the modules take turns, each
  measured every `PEAK_EVERY` steps, on every `ROWS_EVERY`-th of its rows), against the
  value where it makes the run fail (`report.limits.overflow_limit`: 65504 in float16;
  1.8e19 in float32 and bfloat16, whose square overflows); seen by one global forward
  hook while the loss is computed (`Precursors`: nothing on the model);
- each softmax and log_softmax (wrapped in torch while the probe listens:
  `runtime.wrappers`, `runtime.softmax_watch`): the widest spread (max - min) of its
  rows (one pass, each row's min and max; a row holding a masked position, a gap beyond
  `MASK_GAP`: -inf, the dtype's minimum, -1e4, counts 0), against the spread past which
  its smallest probability rounds to 0 in the dtype it ran in
  (`report.limits.underflow_spread`: 17.3 in float16); and whether its output went to a
  log (the one case where that zero is a failure);
- the largest attention logit: of a softmax over a 4-d input (eager attention), or of
  scaled-dot-product attention, recomputed for at most `ATTENTION_ROWS` query rows of
  the batch's first sequence (attention's own kernels never hold the logits);
- each parameter group's update-to-weight ratio |dw| / |w|, from at most
  `SAMPLED_TENSORS` tensors a group and `SAMPLED_VALUES` values of each (a copy before
  the update, four fused `_foreach` calls in all).

The values wait on the device as 0-dim tensors; when the step ends the sentinel stacks
them into its own read (`Sentinel.carry` = `take`), so on CUDA they cost no
synchronisation and arrive with the step's verdict, a step late. `report.forecaster`
turns them into trends and forecasts on the host.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch
from torch import nn

from nandoctor.report.forecaster import Forecaster
from nandoctor.report.limits import dtype_max, overflow_limit, underflow_spread
from nandoctor.report.signals import ACTIVATION_PEAK, ATTENTION_LOGIT, SOFTMAX_SPREAD, Layout, Site
from nandoctor.runtime import calls, global_hooks, softmax_watch, wrappers
from nandoctor.runtime.judge import MIN_SCALE
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.state import TrainingObjects

MASK_GAP = 1e3  # beyond every dtype's underflow spread (104 in float32): a mask, not a logit
ATTENTION_ROWS = 16  # query rows whose logits are recomputed, per attention call
PEAK_EVERY = 2  # a module's output is measured every PEAK_EVERY steps (modules take turns)
ROWS_EVERY = 4  # ...and of a large one, every ROWS_EVERY-th row (the rows taking turns)
SAMPLED_TENSORS = 4  # per parameter group: its largest tensors...
SAMPLED_VALUES = 4096  # ...and of each, its first values
_LIMITS = {ACTIVATION_PEAK: overflow_limit, SOFTMAX_SPREAD: underflow_spread}
_FRAMES = 8  # how far up a softmax's caller is looked for the module that called it


def forecasting(sentinel: Sentinel, objects: TrainingObjects) -> tuple[Precursors, Forecaster]:
    """The precursors probe, its values riding on `sentinel`'s read, and the forecaster
    they go to (its collapse the sentinel's: a scale below 1, or init_scale / 2**16)."""
    probe = Precursors(objects)
    sentinel.carry = probe.take
    scaler = objects.scaler
    min_scale = MIN_SCALE if scaler is None else min(MIN_SCALE, scaler.get_scale() / 2**16)
    return probe, Forecaster(min_scale=min_scale)


class Precursors(Probe):
    """The signals of a step, measured while it runs. Nothing is put on the model (a hook
    on it would be pickled by `torch.save(model)` and copied by `copy.deepcopy(model)`):
    its modules' outputs are seen by one global module forward hook, on only while the
    step's loss is computed (the LOSS phase, the model's forward inside) and filtered to
    the model's modules. It stands aside while a `torch.compile`d module runs, as
    `StepHooks`' global hooks do (torch warns about any global hook at each call of a
    compiled module, and traces it into its graph), and measures that module's output as
    it returns (`call_ended`); compiled code traces nothing of it (`is_compiling` first)."""

    forward_phase = False  # NB: its own hook sees every module's output

    def __init__(self, objects: TrainingObjects) -> None:
        self.objects = objects
        self._active = False
        self._step = 0
        self._turn = 0  # the turn whose modules are measured this step
        self._model: nn.Module | None = None  # the model whose modules are known
        self._names: dict[int, str] = {}  # id(module) -> its dotted path
        self._turns: dict[int, tuple[str, int]] = {}  # id(measured module) -> path, turn
        self._window = False  # the loss is being computed: the model's outputs are measured
        self._compiled = 0  # compiled modules' calls under way: the hook stands aside
        self._handle: global_hooks.Handle | None = None  # the global hook, while it is on
        self._sites: dict[tuple, Site] = {}  # NB: made once each (a dataclass a call costs)
        self._logged: set[tuple[str | None, str, str]] = set()  # softmaxes seen logged
        self._last: torch.Tensor | None = None  # the last output measured (a container's)
        self._before: tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, ...]] | None = None
        self._sample: tuple[Any, tuple[int, ...], list[torch.Tensor], tuple[int, ...]] | None
        self._sample = None
        self._reset()

    def _reset(self) -> None:
        self._peaks: list[Site] = []
        self._maxes: list[torch.Tensor] = []
        self._mins: list[torch.Tensor] = []
        self._others: list[Site] = []
        self._values: list[torch.Tensor] = []
        self._outputs: dict[int, tuple[int, weakref.ref]] = {}  # a softmax's output -> index
        self._updates: list[torch.Tensor] = []
        self._groups: tuple[int, ...] = ()
        self._last = None

    # -- attach --------------------------------------------------------------------------
    def __enter__(self) -> Precursors:
        wrappers.listen_softmaxes(self)
        calls.follow_compiled(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_window()
        calls.unfollow(self)
        wrappers.stop_listening_softmaxes(self)
        self._active, self._compiled = False, 0

    def _know(self, model: nn.Module) -> None:
        """The model's modules: each one's path, and of those whose output is measured,
        the turn (modules take turns, `PEAK_EVERY`)."""
        self._names = {id(m): name for name, m in model.named_modules()}
        measured = [(name, m) for name, m in model.named_modules() if _owns_values(m)]
        self._turns = {id(m): (name, turn % PEAK_EVERY) for turn, (name, m) in enumerate(measured)}
        self._model = model

    # -- the global hook's window: the loss phase -------------------------------------------
    def _open_window(self) -> None:
        model = self.objects.model
        if model is None:
            return
        if model is not self._model:
            self._know(model)  # NB: a hooked run meets its model at its first forward
        self._window = True
        self._arm()

    def _close_window(self) -> None:
        self._window, self._last = False, None  # NB: hold no output past the forward
        self._disarm()

    def _arm(self) -> None:
        if self._handle is None and self._window and not self._compiled:
            self._handle = global_hooks.module_forward(self._on_output)

    def _disarm(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def call_started(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """A compiled module's call begins (`calls.follow_compiled`): the hook stands aside."""
        self._compiled += 1
        self._disarm()

    def call_ended(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> None:
        """...and ends: its output is measured here, as the module's (the model's own, for
        `torch.compile(model)`); what ran inside it, never (its graph holds no hook)."""
        self._compiled = max(0, self._compiled - 1)
        self._arm()
        if self._window and output is not None:
            inner = getattr(module, "_orig_mod", module)
            self._measure(module if id(module) in self._turns else inner, output)

    # -- the step ------------------------------------------------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self._close_window()  # NB: a step the user's loop abandoned mid-forward
        self._reset()
        self._active, self._step = True, ctx.step
        self._turn = ctx.step % PEAK_EVERY

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.LOSS:
            self._open_window()
        elif phase is Phase.OPTIMIZER:
            self._close_window()
            self._before = self._weights_before()
        elif phase is Phase.BACKWARD:
            self._close_window()  # NB: a loss the hooks could not see end (not a scalar)

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.LOSS:
            self._close_window()
        elif phase is Phase.OPTIMIZER and self._before is not None:
            self._update_norms(*self._before)
            self._before = None

    def step_ended(self, ctx: StepContext) -> None:
        self._close_window()
        self._active = False
        self._reset()

    def take(self) -> tuple[Layout, torch.Tensor] | None:
        """The step's values, for the sentinel to read with its own (`Sentinel.carry`)."""
        values = [*self._maxes, *self._mins, *self._values, *self._updates]
        if not values:
            return None
        layout = Layout(tuple(self._peaks), tuple(self._others), self._groups, self._dtype())
        return layout, torch.stack(values)  # NB: promoted to the widest dtype among them

    # -- module outputs ------------------------------------------------------------------
    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        """The global forward hook: every module's call while the window is open."""
        if torch.compiler.is_compiling():  # NB: first: a compiled region traces nothing of it
            return
        self._measure(module, output)

    def _measure(self, module: nn.Module, output: Any) -> None:
        """The model's modules alone, half of them a step, in turn (a trend needs no more)."""
        measured = self._turns.get(id(module))
        if measured is None or measured[1] != self._turn or not self._active:
            return
        t = _first_floating(output)
        if t is None or t.numel() == 0:
            return
        last = self._last
        if last is not None and (t is last or _same_values(t, last)):
            return  # NB: a container handing on its last module's output (or a view)
        self._last = t
        low, high = torch.aminmax(self._rows(t.detach()))
        self._peaks.append(self._site(ACTIVATION_PEAK, measured[0], None, t.dtype))
        self._maxes.append(high)
        self._mins.append(low)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor of many rows (tokens, samples): every `ROWS_EVERY`-th, from a first that
        moves on each time (an outlier feature sits in a channel, across every token); a
        small one whole. NB: each pass over an activation costs a read of all of it."""
        rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 0
        if rows < 4 * ROWS_EVERY or not x.is_contiguous():
            return x
        start = (self._step // PEAK_EVERY) % ROWS_EVERY
        return x.view(-1, x.shape[-1])[start::ROWS_EVERY]

    def _site(self, metric: str, module: str | None, op: str | None, dtype: torch.dtype) -> Site:
        key = (metric, module, op, dtype)
        site = self._sites.get(key)
        if site is None:
            name = _dtype_name(dtype)
            limit = _LIMITS.get(metric, dtype_max)(name)
            logged = (module, op or "", name) in self._logged
            site = self._sites[key] = Site(metric, module, op, name, limit, logged=logged)
        return site

    # -- softmax_watch.SoftmaxListener ------------------------------------------------------------
    def softmax_called(self, op: str, x: torch.Tensor, dim: int, out: torch.Tensor) -> None:
        if not self._active or not x.is_floating_point() or x.numel() == 0:
            return
        module = self._caller()
        with torch.no_grad():
            spread, top = _row_spread_and_top(x.detach(), dim)
        self._outputs[id(out)] = (len(self._others), weakref.ref(out))
        self._add(self._site(SOFTMAX_SPREAD, module, op, out.dtype), spread)
        if x.dim() >= 4:  # NB: (batch, heads, queries, keys): an eager attention's
            self._add(self._site(ATTENTION_LOGIT, module, op, x.dtype), top)

    def attention_called(self, args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._active:
            return
        try:
            with torch.no_grad():
                logits = _attention_logits(args, kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):  # NB: never the user's step
            return
        if logits is None:
            return
        spread, top = _masked_spread_and_top(logits)
        module = self._caller()
        # NB: its kernels accumulate the logits in float32 whatever q's dtype
        self._add(self._site(SOFTMAX_SPREAD, module, softmax_watch.SDPA, torch.float32), spread)
        self._add(self._site(ATTENTION_LOGIT, module, softmax_watch.SDPA, torch.float32), top)

    def log_called(self, x: torch.Tensor) -> None:
        made = self._outputs.get(id(x)) if self._active else None
        if made is None or made[1]() is not x:
            return
        index = made[0]
        site = self._others[index]
        if not site.logged:
            self._logged.add((site.module, site.op or "", site.dtype))
            key = (site.metric, site.module, site.op, x.dtype)
            self._sites[key] = self._others[index] = Site(
                site.metric, site.module, site.op, site.dtype, site.limit, logged=True
            )

    def _add(self, site: Site, value: torch.Tensor) -> None:
        self._others.append(site)
        self._values.append(value)

    def _caller(self) -> str | None:
        """The module whose forward called the op (None: outside the model, the loss)."""
        frame: FrameType | None = sys._getframe(3)
        for _ in range(_FRAMES):
            if frame is None:
                break
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in self._names:
                return self._names[id(owner)]
            frame = frame.f_back
        return None

    # -- updates ---------------------------------------------------------------------------
    def _weights_before(self) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[int, ...]]:
        views, groups = self._sampled()
        if not views:
            return [], [], ()
        return views, list(torch._foreach_mul(views, 1.0)), groups

    def _update_norms(
        self, views: list[torch.Tensor], before: list[torch.Tensor], groups: tuple[int, ...]
    ) -> None:
        if not views:
            return
        moved = torch._foreach_norm(torch._foreach_sub(views, before))
        self._updates = [*moved, *torch._foreach_norm(before)]  # NB: |dw| / |w| before it
        self._groups = groups

    def _sampled(self) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        """Views of the sampled values of each group's largest tensors (chosen once per
        optimizer and group sizes)."""
        optimizer = self.objects.optimizer
        if optimizer is None:
            return [], ()
        shape = tuple(len(g["params"]) for g in optimizer.param_groups)
        if self._sample is None or self._sample[0] is not optimizer or self._sample[1] != shape:
            views, groups = _sample_views(optimizer)
            self._sample = (optimizer, shape, views, groups)
        return self._sample[2], self._sample[3]

    def _dtype(self) -> str:
        params = self.objects.params
        return _dtype_name(params[0].dtype) if params else "float32"


def _sample_views(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], tuple[int, ...]]:
    views: list[torch.Tensor] = []
    groups: list[int] = []
    for index, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.requires_grad and p.is_floating_point()]
        largest = sorted(params, key=lambda p: -p.numel())[:SAMPLED_TENSORS]
        for p in largest:
            if p.is_contiguous():
                views.append(p.detach().view(-1)[:SAMPLED_VALUES])
                groups.append(index)
    return views, tuple(groups)


def _row_spread_and_top(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """0-dim: the widest spread of a row that holds no masked position, and the largest
    value. One pass over `x` (each row's min and max); a row with a mask (a gap beyond
    `MASK_GAP`: -inf, the dtype's minimum, -1e4) counts 0: its underflow is meant."""
    low, high = torch.aminmax(x, dim=dim)
    gap = high - low
    return torch.where(gap < MASK_GAP, gap, 0).amax(), high.amax()  # NB: NaN gaps too


def _masked_spread_and_top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for a few recomputed attention rows, the masked positions themselves left
    out (a causal mask masks every row but the last)."""
    top = logits.amax(-1, keepdim=True)
    gap = top - logits
    return torch.where(gap < MASK_GAP, gap, 0).amax(), top.amax()


def _attention_logits(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The logits of scaled-dot-product attention for at most `ATTENTION_ROWS` query rows
    (strided) of the batch's first sequence, with its mask applied (a boolean mask's False
    positions left at -inf)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    q, k = given.get("query"), given.get("key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 2:
        return None
    rows = torch.arange(0, q.shape[-2], max(1, q.shape[-2] // ATTENTION_ROWS), device=q.device)
    mask = given.get("attn_mask")
    if isinstance(mask, torch.Tensor):
        mask = mask.expand(*q.shape[:-1], k.shape[-2])
    if q.dim() >= 4:  # NB: (batch, heads, queries, dim): the first sequence's
        q, k = q[:1], k[:1]
        mask = mask[:1] if isinstance(mask, torch.Tensor) else mask
    if k.dim() >= 3 and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:  # grouped-query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = given.get("scale") or q.shape[-1] ** -0.5
    logits = (q.index_select(-2, rows).float() @ k.float().transpose(-2, -1)) * scale
    if isinstance(mask, torch.Tensor):
        mask = mask.index_select(-2, rows)
        boolean = mask.dtype == torch.bool
        logits = logits.masked_fill(~mask, -torch.inf) if boolean else logits + mask
    if given.get("is_causal"):
        keys = torch.arange(k.shape[-2], device=q.device)
        logits = logits.masked_fill(keys[None, :] > rows[:, None], -torch.inf)
    return logits


def _owns_values(module: nn.Module) -> bool:
    """A module whose output is measured: one with weights of its own, or one holding
    others (a block: its output is the residual stream). NB: not a parameterless leaf (an
    activation, a dropout, a softmax): its output is its input's, reshaped."""
    has_children = next(module.children(), None) is not None
    return has_children or next(module.parameters(recurse=False), None) is not None


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` is a view of all of `b` (a squeeze, a reshape): the same values, measured once."""
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def _first_floating(output: Any) -> torch.Tensor | None:
    """A module's output tensor: itself, or the first floating tensor of a tuple, a list or
    a mapping (transformers' outputs)."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    items = output.values() if isinstance(output, Mapping) else output
    if isinstance(items, (tuple, list)) or isinstance(output, Mapping):
        for item in list(items)[:3]:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["Precursors", "forecasting"]
