"""The config file's schema: what each key means, its type and its default.

The shape is the contract of SPEC.md ("Config"); `nandoctor schema` prints it as JSON
Schema. Reading the YAML and turning validation errors into one-line messages is the job
of `configfile.py`; this module only declares.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from nandoctor.setup.dtypes import canonical_dtype
from nandoctor.setup.limits import MAX_STEPS

# a file (`path/file.py`: spaces allowed, "Google Drive/train.py") or a module by its
# absolute dotted name, then the attribute's dotted path
_NAME = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"
_ENTRYPOINT = re.compile(rf"^(?:(?=[^\s:])[^:]*\.py|{_NAME}):{_NAME}$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_entrypoint(value: str) -> str:
    if not _ENTRYPOINT.match(value):
        relative = value.startswith(".") and ".py:" not in value
        raise ValueError(
            "expected an entrypoint 'package.module:attribute' or 'path/file.py:attribute'"
            + (
                "; a module is named from its top package, not relative to the config"
                if relative
                else ""
            )
        )
    return value


def check_device(value: str) -> str:
    if not _DEVICE.match(value):
        raise ValueError("expected auto, cpu, cuda or cuda:N")
    return value


def _not_a_bool(value: Any) -> Any:
    # NB: YAML reads `no`, `off` and `false` as booleans; pydantic would take them as 0.
    if isinstance(value, bool):
        raise ValueError("expected a number (YAML reads yes, no, on, off as booleans)")
    return value


def _numeric_strings_as_numbers(kwargs: dict[str, Any]) -> dict[str, Any]:
    # NB: YAML 1.1 reads `lr: 3e-4` (no dot) as a string; no optimizer wants a string number.
    return {k: _as_number(v) if isinstance(v, str) else v for k, v in kwargs.items()}


def _as_number(text: str) -> Any:
    try:
        return int(text) if _INT.match(text) else float(text) if _FLOAT.match(text) else text
    except ValueError:
        return text


as_number = _as_number  # setup.args reads model_args and data_args the same way


def _auto_or_count(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError("expected auto or a positive whole number of steps")


_INT = re.compile(r"^[-+]?\d+$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

Entrypoint = Annotated[str, AfterValidator(_check_entrypoint)]
DtypeName = Annotated[str, AfterValidator(canonical_dtype)]
DeviceName = Annotated[str, AfterValidator(check_device)]
# NB: finite: an init_scale of inf skips every step (halved, it stays inf) and reads healthy
Number = Annotated[PositiveFloat, Field(allow_inf_nan=False), BeforeValidator(_not_a_bool)]
Count = Annotated[PositiveInt, BeforeValidator(_not_a_bool)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FactorySpec(BaseModel):
    """A torch class by `name`, or a `factory` entrypoint; every other key is a kwarg.

    `{name: AdamW, lr: 3e-4}` builds `torch.optim.AdamW(params, lr=3e-4)`;
    `{factory: "mypkg.opt:build", lr: 1e-3}` calls `build(params, lr=1e-3)`.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str | None = Field(None, description="class name in torch.optim or its lr_scheduler")
    factory: Entrypoint | None = Field(None, description="callable(params or optimizer, **kwargs)")

    @model_validator(mode="after")
    def _one_of_name_or_factory(self) -> FactorySpec:
        if (self.name is None) == (self.factory is None):
            raise ValueError("expected exactly one of `name` or `factory`")
        return self

    @property
    def kwargs(self) -> dict[str, Any]:
        return _numeric_strings_as_numbers(dict(self.model_extra or {}))


class Precision(_Section):
    dtype: DtypeName = Field(
        "float16", description="float16 | bfloat16 | float32 (or fp16, bf16, fp32)"
    )
    grad_scaler: bool | None = Field(None, description="default: true for float16, false otherwise")
    init_scale: Number = 65536.0
    autocast_policy: Literal["cuda", "native"] = Field(
        "cuda",
        description="cuda: CUDA's autocast cast lists on any device | native: the device's own",
    )

    @property
    def use_grad_scaler(self) -> bool:
        return self.grad_scaler if self.grad_scaler is not None else self.dtype == "float16"


class SnapshotPolicy(_Section):
    """How often the fast run copies the training state aside, so a step can be replayed."""

    every: Annotated[Literal["auto"] | PositiveInt, BeforeValidator(_auto_or_count)] = Field(
        "auto", description="auto: every 32 steps for small states, up to 64 for large ones"
    )

    @property
    def steps(self) -> int | None:
        return None if self.every == "auto" else int(self.every)


class FsdpMixedPrecision(_Section):
    """FSDP2's `MixedPrecisionPolicy`: the dtype of the unsharded parameters the forward and
    backward compute with, and the dtype gradients are reduce-scattered in."""

    param_dtype: DtypeName | None = Field(None, description="default: the parameters' own")
    reduce_dtype: DtypeName | None = Field(None, description="default: param_dtype")


class DistributedConfig(_Section):
    """Data-parallel runs: `nandoctor diagnose` relaunches itself on this many processes."""

    nproc_per_node: Count = Field(1, description="processes on this node (1: no launch)")
    backend: Literal["gloo", "nccl"] | None = Field(
        None, description="default: nccl on CUDA, gloo on CPU"
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: DistributedDataParallel; fsdp: FSDP2 fully_shard"
    )
    shard_modules: list[str] | None = Field(
        None,
        description="fsdp: module paths (or class names) to fully_shard before the root; "
        "default: each child module that holds parameters",
    )
    mixed_precision: FsdpMixedPrecision | None = Field(
        None, description="fsdp: MixedPrecisionPolicy (param_dtype, reduce_dtype)"
    )
    timeout_s: Number = Field(300.0, description="a rank that hangs this long ends the job")

    @model_validator(mode="after")
    def _fsdp_keys_need_fsdp(self) -> DistributedConfig:
        if self.strategy != "fsdp":
            for key in ("shard_modules", "mixed_precision"):
                if getattr(self, key) is not None:
                    raise ValueError(f"`{key}` applies to strategy: fsdp only")
        return self


class Config(_Section):
    """A training run to replay. Paths are relative to the config file."""

    name: str | None = Field(None, description="shown in reports")
    python_path: list[str] = Field(default_factory=list, description="folders put on sys.path")
    model: Entrypoint = Field(description="callable(**model_args) -> torch.nn.Module")
    model_args: dict[str, Any] = Field(default_factory=dict)
    data: Entrypoint = Field(description="callable(**data_args) -> iterable of batches")
    data_args: dict[str, Any] = Field(default_factory=dict)
    loss: Entrypoint | None = Field(
        None,
        description="callable(model, batch) -> scalar loss; default cross_entropy(model(x), y)",
    )
    optimizer: FactorySpec
    scheduler: FactorySpec | None = None
    precision: Precision = Field(default_factory=Precision)
    clip_grad_norm: Number | None = Field(
        None, description="unscale_ then clip_grad_norm_ to this max norm"
    )
    steps: Count = Field(500, le=MAX_STEPS, description="optimizer steps to replay; epochs cycle")
    grad_accum_steps: Count = Field(
        1, description="micro-batches per optimizer step, each loss divided by it"
    )
    device: DeviceName = "auto"
    seed: Annotated[int, BeforeValidator(_not_a_bool)] = Field(0, ge=0, lt=2**32)
    snapshot: SnapshotPolicy = Field(default_factory=SnapshotPolicy)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: str | None = Field(
        None, description="state_dict, or {model, optimizer, scaler, step}; weights_only load"
    )
