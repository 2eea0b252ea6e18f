"""Turn a config into the live objects of a training run, calling the user's code once.

A `Session` is what the loop steps: model, batches, loss, optimizer, scheduler, scaler,
device and dtype. Building one seeds the RNGs first, so two sessions from the same config
start from the same weights and see the same batches.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import itertools
import math
import random
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from nandoctor.errors import ConfigError, kind_of
from nandoctor.setup import checkpoint as ckpt
from nandoctor.setup import cuda_autocast, distributed, fsdp
from nandoctor.setup.args import conversion_notes, numeric_args
from nandoctor.setup.data import BatchStream
from nandoctor.setup.devices import check_dtype_supported, resolve_device
from nandoctor.setup.distributed import Ranks
from nandoctor.setup.dtypes import torch_dtype
from nandoctor.setup.entrypoints import add_python_path, resolve
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.scaler import build_scaler
from nandoctor.setup.schema import Config, FactorySpec
from nandoctor.setup.user_code import user_code

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass
class Session:
    config: Config
    config_path: Path
    model: torch.nn.Module
    loss_fn: LossFn
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    scaler: torch.amp.GradScaler | None
    device: torch.device
    dtype: torch.dtype
    batches: BatchStream
    start_step: int = 0
    notes: list[str] = field(default_factory=list)
    ranks: Ranks | None = None  # this process's place in a data-parallel job
    train_model: torch.nn.Module | None = None  # what the loss calls: the DDP wrapper, or model
    _params: list[torch.nn.Parameter] | None = field(default=None, init=False, repr=False)
    _params_of: torch.nn.Module | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.train_model is None:
            self.train_model = self.model

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, as the run's start found them (the optimizer was built
        from them). NB: kept, not walked again: the sentinel asks every step, and walking a
        transformer's modules costs more than checking a small model's gradients."""
        if self._params is None or self._params_of is not self.model:
            self._params = [p for p in self.model.parameters() if p.requires_grad]
            self._params_of = self.model
        return self._params

    @property
    def others(self) -> list[torch.nn.Module]:
        return []  # NB: a config trains one model

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forward and backward compute in: autocast's, or, where a float32 run
        shards with FSDP's MixedPrecisionPolicy, its `param_dtype` (the common way to train
        FSDP in bfloat16: no autocast at all), or, without autocast, the weights' own (a
        model the builder made `.half()` computes in float16 whatever the config's dtype).
        The report's `dtype`, and the float16 range the headroom measures against, are
        this one's."""
        if self.dtype != torch.float32:
            return self.dtype
        mixed = self.config.distributed.mixed_precision
        sharded = self.ranks is not None and self.config.distributed.strategy == "fsdp"
        if sharded and mixed is not None and mixed.param_dtype:
            return torch_dtype(mixed.param_dtype)
        return _weights_dtype(self.params) or self.dtype

    @property
    def clip_grad_norm(self) -> float | None:
        return self.config.clip_grad_norm

    @property
    def clipped_scaled(self) -> int | None:
        return None  # NB: the step always unscales before it clips

    @property
    def autocast_policy(self) -> str:
        """Whose autocast lists the forward runs under: `cuda` or the device's (`native`)."""
        return self.config.precision.autocast_policy

    @property
    def emulates_cuda_autocast(self) -> bool:
        """CUDA's lists are emulated where autocast is the CPU's (on CUDA they are native)."""
        return (
            self.autocast_policy == "cuda"
            and self.device.type == "cpu"
            and self.dtype != torch.float32
        )

    def autocast_scope(self) -> contextlib.AbstractContextManager[None]:
        """Keeps the emulation of CUDA's lists installed, when there is one, until exit: a
        run enters it once around all its steps, so each step's autocast costs nothing."""
        return cuda_autocast.emulated() if self.emulates_cuda_autocast else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The forward's autocast; none at all in float32, as a float32 loop is written
        (NB: a disabled autocast entered every step still costs ~0.05 ms on a CPU step)."""
        return self._autocast() if self.dtype != torch.float32 else _NO_AUTOCAST

    @contextlib.contextmanager
    def _autocast(self) -> Iterator[None]:
        with self.autocast_scope(), torch.autocast(self.device.type, self.dtype):
            yield


_NO_AUTOCAST = contextlib.nullcontext()


def _weights_dtype(params: list[torch.nn.Parameter]) -> torch.dtype | None:
    """The floating dtype most of the weights hold (by elements), if any weights float."""
    counts: dict[torch.dtype, int] = {}
    for p in params:
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def build_session(loaded: LoadedConfig) -> Session:
    """The run the config describes, built; a config error names the file and key."""
    try:
        return _build_session(loaded)
    except ConfigError as e:
        raise loaded.placed(e) from None


def _build_session(loaded: LoadedConfig) -> Session:
    config, base = loaded.config, loaded.base_dir
    add_python_path(base, config.python_path)
    ranks = distributed.join(config.distributed, config.device)
    device = ranks.device if ranks is not None else resolve_device(config.device)
    dtype = torch_dtype(config.precision.dtype)
    check_dtype_supported(device, dtype)
    seed_everything(config.seed)
    model = _build_model(config, base).to(device)
    state = ckpt.load(base / config.checkpoint) if config.checkpoint else None
    if state is not None:
        ckpt.restore_model(model, state)
    start = state.step if state is not None else 0
    where = f"data ({config.data})"
    source = _data_source(config, base, ranks)
    stream = BatchStream(source, start, accum=config.grad_accum_steps, where=where)
    sharded = ranks is not None and config.distributed.strategy == "fsdp"
    if sharded:  # NB: before the optimizer, which steps each rank's shards
        fsdp.shard(model, config.distributed, cast(Ranks, ranks))
    optimizer = build_optimizer(config.optimizer, model, base)
    scheduler = build_scheduler(config.scheduler, optimizer, base) if config.scheduler else None
    scaler = build_scaler(config.precision, device, optimizer, model)
    if state is not None:
        if sharded and state.optimizer is not None:  # whole tensors: cut this rank's shards
            state = replace(state, optimizer=fsdp.shard_optimizer_state(optimizer, state.optimizer))
        ckpt.restore_training_state(state, optimizer, scaler)
    loss_fn = resolve(config.loss, "loss", base) if config.loss else default_loss
    parts = (model, loss_fn, optimizer, scheduler, scaler, device, dtype, stream, start)
    session = Session(config, loaded.path, *parts)
    session.notes += conversion_notes(config)
    if ranks is not None:
        session.ranks, session.train_model = ranks, model if sharded else ranks.wrap(model)
    # NB: the data is built as the user's script builds it, after the model (docs/config.md,
    # "Data and steps"): a builder that draws from the global RNG draws what it draws there.
    # Nothing since the model drew from it; last, so that a rank whose data raises has
    # passed the collectives of the setup (DDP's broadcast) that the other ranks wait in.
    stream.build()
    return session


def _data_source(config: Config, base: Path, ranks: Ranks | None) -> Callable[[], Any]:
    data = resolve(config.data, "data", base)
    args = numeric_args(config.data_args)
    # NB: on a rank, `Ranks.shard` may add the rank and world size: only keywords checked
    _check_arguments(data, "data_args", config.data, (), args, partial=ranks is not None)
    if ranks is not None:
        return ranks.shard(data, args)
    return lambda: data(**args)


def seed_everything(seed: int) -> None:
    """Seed Python, torch (every device) and numpy when the user's code has imported it.

    NB: on CUDA, cuDNN is also asked for deterministic kernels and no autotuning, so that
    the replay of a bad step computes what the run computed; kernels that have no
    deterministic version can still differ, and then the report says "not reproduced".
    """
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Without a `loss:` entry, a batch is `(x, y)` and the loss is cross-entropy."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(
            f"loss: the default loss expects batches (x, y); got a {_describe(batch)}",
            hint="name a `loss:` callable(model, batch) -> scalar tensor in the config",
        )
    x, y = batch
    logits = model(x)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(
            "loss: the default loss expects model(x) to return a tensor of logits; "
            f"it returned {kind_of(logits)}",
            hint="name a `loss:` callable(model, batch) -> scalar tensor in the config",
        )
    return F.cross_entropy(logits, y)


def _describe(batch: Any) -> str:
    if isinstance(batch, (tuple, list)):
        return f"{type(batch).__name__} of {len(batch)}"
    return type(batch).__name__


def _check_arguments(
    fn: Callable[..., Any],
    key: str,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    partial: bool = False,
) -> None:
    """The config's arguments fit `fn`'s signature (with `partial`, some may be left for
    later), or a config error names the key: a misspelt keyword is the config's mistake,
    not a crash of the user's code."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # NB: no signature to read (a builtin): the call says
        return
    try:
        (signature.bind_partial if partial else signature.bind)(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"{key}: {name}{signature} {e}") from None


def _build_model(config: Config, base: Path) -> torch.nn.Module:
    factory = resolve(config.model, "model", base)
    args = numeric_args(config.model_args)
    _check_arguments(factory, "model_args", config.model, (), args)
    with user_code(f"model {config.model}"):
        model = factory(**args)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model: {config.model} returned {kind_of(model)}, expected a torch.nn.Module"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model: {config.model} built a model with no trainable parameters")
    meta = [
        n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta
    ]
    if meta:  # NB: .to(device) of a meta tensor raises torch's NotImplementedError
        raise ConfigError(
            f"model: {config.model} built a model whose weights are on the meta device, with "
            f"no values ({_names(meta)}): build it on a real device, or materialise it in the "
            "builder (model.to_empty(device=...), then initialise or load its weights)"
        )
    return model


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def build_optimizer(spec: FactorySpec, model: torch.nn.Module, base: Path) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _build_from_spec(
        spec, "optimizer", torch.optim, torch.optim.Optimizer, params, base
    )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer: {spec.factory} returned {kind_of(optimizer)}, expected a "
            "torch.optim.Optimizer"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not any(id(p) in held for p in params):  # NB: a run whose weights never change
        raise ConfigError(
            f"optimizer: {spec.factory or spec.name} holds none of the model's trainable "
            "parameters: the model would never train (give it the params it is called with)"
        )
    return optimizer


def build_scheduler(spec: FactorySpec, optimizer: torch.optim.Optimizer, base: Path) -> Any:
    lr_scheduler = torch.optim.lr_scheduler
    scheduler = _build_from_spec(
        spec, "scheduler", lr_scheduler, lr_scheduler.LRScheduler, optimizer, base
    )
    # NB: the snapshots keep its state; the step calls its step()
    if not all(callable(getattr(scheduler, m, None)) for m in _SCHEDULER_METHODS):
        raise ConfigError(
            f"scheduler: {spec.factory} returned {kind_of(scheduler)}, expected a learning "
            f"rate scheduler (torch.optim.lr_scheduler's, or any object with "
            f"{', '.join(f'{m}()' for m in _SCHEDULER_METHODS)})"
        )
    return scheduler


_SCHEDULER_METHODS = ("step", "state_dict", "load_state_dict")


def _build_from_spec(
    spec: FactorySpec, key: str, namespace: Any, base_class: type, arg: Any, base: Path
) -> Any:
    if spec.factory is not None:
        factory = resolve(spec.factory, f"{key}.factory", base)
        _check_arguments(factory, key, spec.factory, (arg,), spec.kwargs)
        _refuse_non_numbers(factory, key, spec.kwargs)
        with user_code(f"{key} factory {spec.factory}"):
            return factory(arg, **spec.kwargs)
    name = spec.name or ""
    cls: Any = getattr(namespace, name, None)
    if cls is base_class:
        raise ConfigError(
            f"{key}.name: {name} is the base class of {namespace.__name__}'s classes, not "
            "one of them (name one, such as AdamW or CosineAnnealingLR)"
        )
    if not (isinstance(cls, type) and issubclass(cls, base_class)) or name.startswith("_"):
        hint = _suggest(spec.name, namespace, base_class)
        raise ConfigError(f"{key}.name: {namespace.__name__} has no class '{spec.name}'{hint}")
    _refuse_non_numbers(cls, key, spec.kwargs)
    try:
        return cast(Any, cls)(arg, **spec.kwargs)  # isinstance narrowed it to `type`
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: {spec.name}({_kwargs_text(spec.kwargs)}) refused: {e}") from None


def _refuse_non_numbers(fn: Any, key: str, kwargs: dict[str, Any]) -> None:
    """YAML reads `yes`, `no`, `on` and `off` as booleans, and Python takes True for 1:
    `lr: on` trained SGD at a rate of 1, silently. A boolean is refused where the
    signature wants a number (its default or its annotation says int or float, not bool);
    `nesterov: yes` stays the boolean it is. So is a word (`lr: fast`), which the
    optimizer refused with Python's own `'<=' not supported between ...`."""
    for name, value in kwargs.items():
        if _not_finite(value):  # NB: lr: .nan made every weight NaN at step 0, no cause named
            raise ConfigError(f"{key}.{name}: expected a finite number, got {value!r}")
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # NB: a builtin without a signature: nothing to check
        return
    for name, value in kwargs.items():
        param = parameters.get(name)
        if not isinstance(value, (bool, str)) or param is None or not _wants_number(param):
            continue
        if isinstance(value, bool):
            raise ConfigError(
                f"{key}.{name}: expected a number, got {str(value).lower()} "
                "(YAML reads yes, no, on, off as booleans)"
            )
        # NB: numeric strings ('3e-4') were read as numbers already (`conversion_notes`)
        raise ConfigError(f"{key}.{name}: expected a number, got {value!r}")


def _not_finite(value: Any) -> bool:
    """A float that is NaN or infinite, alone or in a list (Adam's betas)."""
    if isinstance(value, (list, tuple)):
        return any(_not_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


def _wants_number(param: inspect.Parameter) -> bool:
    default, annotation = param.default, param.annotation
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return True
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    text = text or str(annotation)
    return not re.search(r"\bbool\b", text) and bool(re.search(r"\b(int|float)\b", text))


def _suggest(name: str | None, namespace: Any, base_class: type) -> str:
    names = [
        n
        for n in dir(namespace)
        if not n.startswith("_") and isinstance(getattr(namespace, n), type)
    ]
    names = [n for n in names if issubclass(getattr(namespace, n), base_class)]
    same_letters = [n for n in names if n.lower() == (name or "").lower()]
    close = same_letters or difflib.get_close_matches(name or "", names, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
