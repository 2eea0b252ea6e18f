"""Sharded data parallelism (FSDP2 `fully_shard`) on the CPU with gloo, two ranks launched
through torchrun's code: the report names the step, the phase and the rank where the NaN
was born, as for DDP; the shards train exactly as DDP's replicas do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from nandoctor.errors import ConfigError
from nandoctor.setup import fsdp
from nandoctor.setup.load import load_config
from tests.helpers.jobs import run_job
from tests.helpers.paths import REPO
from tests.setup.test_distributed import TRAIN, run_two_ranks

FSDP = "distributed: {strategy: fsdp}\n"

# A loss whose backward alone goes non-finite on a gated batch: sqrt'(0) is inf, and the
# gradient flowing into it is 0, so the model's gradients get inf * 0 = NaN; the forward
# (sqrt(0) = 0) and the loss stay finite.
TRAIN_BACKWARD = (
    TRAIN
    + """

import torch.nn.functional as F


_ungated = build_data


def build_data(rank, world_size, bad_rank=None, bad_step=None):
    out = []
    for x, y in _ungated(rank, world_size):
        gate = torch.zeros(()) if (rank == bad_rank and len(out) == bad_step) else torch.ones(())
        out.append((x, y, gate))
    return out


def gated_loss(model, batch):
    x, y, gate = batch
    logits = model(x)
    return F.cross_entropy(logits, y) + 1e-3 * torch.sqrt(((logits * gate) ** 2).sum())
"""
)


@pytest.mark.slow
def test_a_nan_in_rank_1s_fifth_batch_is_born_on_rank_1_and_rank_0_inherited_it(tmp_path):
    proc, report = run_two_ranks(tmp_path, {"nan_rank": 1, "nan_step": 5}, extra=FSDP)
    assert proc.returncode == 1, proc.stderr
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["tensor"]) == (5, "input", "input:0")
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["status"] == "origin" and ranks[1]["first_nonfinite"]["phase"] == "input"
    assert ranks[0]["status"] == "inherited" and ranks[0]["first_nonfinite"]["phase"] == "backward"
    assert "born on rank 1 (rank 0 inherited it" in report["summary"]
    assert report["causes"][0]["id"] == "nonfinite-input"
    assert report["steps_completed"] == 5


LAYERED = (
    TRAIN
    + """

class Layered(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def build_model():
    return Layered()
"""
)


@pytest.mark.slow
def test_a_model_whose_blocks_are_in_a_module_list_is_sharded_and_diagnosed(tmp_path):
    """The usual `self.layers = nn.ModuleList(...)`, sharded by default (it was an
    internal error: `fully_shard` refuses a container without forward)."""
    proc, report = run_two_ranks(
        tmp_path, {"nan_rank": 1, "nan_step": 3}, train=LAYERED, extra=FSDP
    )
    assert proc.returncode == 1, proc.stderr
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["tensor"]) == (3, "input", "input:0")


@pytest.mark.slow
def test_a_nan_born_in_rank_0s_backward_is_found_before_the_reduce_scatter(tmp_path):
    config = FSDP + "loss: train.py:gated_loss\n"
    args = {"bad_rank": 0, "bad_step": 3}
    proc, report = run_two_ranks(tmp_path, args, train=TRAIN_BACKWARD, extra=config)
    assert proc.returncode == 1, proc.stderr
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"]) == (3, "backward")
    # the origin op itself (sqrt's backward dividing by 0), not FSDP's reduce-scatter
    assert (first["op"], first["value"]) == ("aten.div.Tensor", "inf"), first
    assert "in the backward of torch.sqrt" in report["summary"]
    assert report["causes"][0]["id"] == "nondifferentiable-point"
    assert [(r["rank"], r["status"]) for r in report["ranks"]] == [(0, "origin"), (1, "inherited")]


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_fsdp_job_with_exit_3(tmp_path):
    proc, report = run_two_ranks(tmp_path, {"raise_rank": 1, "raise_step": 3}, extra=FSDP)
    assert proc.returncode == 3
    assert (
        "rank 1: data (train.py:build_data) raised RuntimeError: rank 1 could not read batch 3"
        in proc.stderr
    )
    assert report is None  # no half-written report


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


def _model() -> nn.Module:
    return nn.Sequential(Block(), Block(), nn.Dropout(0.1), nn.Linear(4, 2))


def test_by_default_each_child_holding_parameters_is_sharded_before_the_root():
    model = _model()
    assert fsdp._targets(model, None) == [model[0], model[1], model[3]]


def test_shard_modules_names_modules_by_path_or_class_and_shards_the_deepest_first():
    model = _model()
    assert fsdp._targets(model, ["Block"]) == [model[0], model[1]]
    assert fsdp._targets(model, ["0", "0.proj"]) == [model[0].proj, model[0]]


class Stack(nn.Module):
    """A transformer's layout: its blocks in an `nn.ModuleList`, which has no forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norms = nn.ModuleDict({"final": nn.LayerNorm(4)})
        self.extra = nn.ParameterList([nn.Parameter(torch.ones(4))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norms["final"](self.embed(x)) * self.extra[0]


def test_a_container_without_forward_is_sharded_one_module_at_a_time():
    """`fully_shard` refuses an `nn.ModuleList`: the default shards each block in it, as a
    name does (`layers`, by path); parameters a container holds itself stay the root's."""
    model = Stack()
    blocks, final = list(model.layers), model.norms["final"]
    assert fsdp._targets(model, None) == [model.embed, *blocks, final]
    assert fsdp._targets(model, ["layers"]) == blocks
    assert fsdp._targets(model, ["norms", "layers.1.proj"]) == [blocks[1].proj, final]


def test_the_root_named_by_its_class_is_sharded_last_as_always():
    model = _model()
    assert fsdp._targets(model, ["Sequential"]) == []
    assert fsdp._targets(model, ["Sequential", "Block"]) == [model[0], model[1]]


def test_a_shard_module_that_names_nothing_or_holds_no_parameters_is_a_config_error():
    with pytest.raises(ConfigError, match=r"named or typed 'Blok'; did you mean 'Block'\?"):
        fsdp._targets(_model(), ["Blok"])
    with pytest.raises(ConfigError, match=r"'0\.act' \(0\.act\) holds no parameters to shard"):
        fsdp._targets(_model(), ["0.act"])
    with pytest.raises(ConfigError, match="the model has no parameters to shard"):
        fsdp._targets(nn.Sequential(nn.ReLU()), None)


@pytest.mark.slow
def test_a_config_error_every_rank_meets_is_one_line_for_the_job(tmp_path):
    """`shard_modules` is checked on the model, so on every rank; the job prints it once
    (the first rank's), not once a rank."""
    extra = "distributed: {strategy: fsdp, shard_modules: [Blok]}\n"
    proc, report = run_two_ranks(tmp_path, {}, extra=extra)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "no module of the model is named or typed 'Blok'" in errors[0]
    assert report is None


def test_fsdp_keys_belong_to_strategy_fsdp(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: m:f\ndata: m:g\noptimizer: {name: SGD, lr: 0.1}\n"
        "distributed: {shard_modules: [Block]}\n"
    )
    with pytest.raises(ConfigError, match="`shard_modules` applies to strategy: fsdp only"):
        load_config(config)
    config.write_text(
        "model: m:f\ndata: m:g\noptimizer: {name: SGD, lr: 0.1}\n"
        "distributed: {strategy: fsdp, shard_modules: [Block], mixed_precision: "
        "{param_dtype: bf16, reduce_dtype: fp32}}\n"
    )
    mixed = load_config(config).config.distributed.mixed_precision
    assert (mixed.param_dtype, mixed.reduce_dtype) == ("bfloat16", "float32")


SNAPSHOT_SCRIPT = """
import os
import types
import torch
import torch.distributed as dist
from torch import nn
from nandoctor.runtime.snapshot import StateSnapshot
from nandoctor.runtime.tensors import local
from nandoctor.setup import fsdp
from nandoctor.setup.distributed import Ranks
from nandoctor.setup.schema import DistributedConfig

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # 3 rows: uneven shards
fsdp.shard(model, DistributedConfig(strategy="fsdp"), Ranks(rank, 2, rank, torch.device("cpu")))
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
objects = types.SimpleNamespace(
    model=model, optimizer=optimizer, scaler=None, scheduler=None, device=torch.device("cpu"),
    others=[], optimizers=[optimizer], params=list(model.parameters()),
)
seeds = [torch.Generator().manual_seed(10 * rank + i) for i in (0, 1, 2)]
batches = [torch.randn(4, 8, generator=g) for g in seeds]

def step(x):
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()

def shards():
    params = [local(p).clone() for p in model.parameters()]
    state = [local(v).clone() for s in optimizer.state.values() for v in s.values()]
    return params + state

step(batches[0])
snapshot = StateSnapshot()
snapshot.capture(objects, 1)
kept = shards()
step(batches[1])
after = shards()
step(batches[2])
snapshot.restore(objects)
assert all(torch.equal(a, b) for a, b in zip(shards(), kept, strict=True)), "restore"
assert all(type(p).__name__ == "DTensor" for p in model.parameters())
step(batches[1])  # the replay of step 1 computes what the run computed
assert all(torch.equal(a, b) for a, b in zip(shards(), after, strict=True)), "replay"
print(f"rank {rank} ok", flush=True)
dist.barrier()
dist.destroy_process_group()
# NB: gloo's threads can still abort the interpreter's teardown on a loaded machine
# ("terminate called without an active exception"); this test is about the snapshot
os._exit(0)
"""


@pytest.mark.slow
def test_a_snapshot_keeps_each_ranks_shards_and_a_replay_from_it_recomputes_the_step(tmp_path):
    script = tmp_path / "snapshot_fsdp.py"
    script.write_text(SNAPSHOT_SCRIPT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = run_job([*launch, str(script)], cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


def test_fsdp_on_a_torch_without_fully_shard_is_a_config_error(monkeypatch):
    def missing(self):
        raise ImportError("cannot import name 'fully_shard'")

    monkeypatch.setattr(fsdp._Api, "__init__", missing)
    with pytest.raises(ConfigError, match=r"strategy: fsdp needs PyTorch's FSDP2 .*does not have"):
        fsdp._fsdp_api()


def _nandoctor(
    tmp_path, *args: str, strategy: str = "fsdp", extra: str = ""
) -> subprocess.CompletedProcess:
    """A command on a config that asks for two ranks itself (`nproc_per_node: 2`);
    `extra`: more keys of its `distributed` section."""
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "config.yaml").write_text(
        "model: train.py:build_model\ndata: train.py:build_data\n"
        "optimizer: {name: SGD, lr: 0.1}\nprecision: {dtype: float32}\nsteps: 6\ndevice: cpu\n"
        f"distributed: {{strategy: {strategy}, nproc_per_node: 2{extra}}}\n"
    )
    command = [sys.executable, "-m", "nandoctor", args[0], str(tmp_path / "config.yaml")]
    return run_job([*command, *args[1:], "-q"], cwd=tmp_path)


@pytest.mark.slow
def test_a_healthy_fsdp_run_exits_0_passes_its_baselines_gate_and_trains_as_ddp_does(tmp_path):
    proc = _nandoctor(tmp_path, "baseline", "--out", "baseline.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "baseline.json").read_text())["health"]["steps"] == 6
    proc = _nandoctor(tmp_path, "diagnose", "--baseline", "baseline.json", "--json", "r.json")
    assert proc.returncode == 0, proc.stderr
    sharded = json.loads((tmp_path / "r.json").read_text())
    assert sharded["status"] == "healthy" and sharded["steps_completed"] == 6
    assert [r["status"] for r in sharded["ranks"]] == ["clean", "clean"]
    checks = sharded["gate"]["checks"]
    assert checks and all(c["passed"] for c in checks), checks
    assert [m["type"] for m in sharded["health"]["modules"]][:2] == ["Sequential", "Linear"]
    (tmp_path / "ddp").mkdir()
    proc = _nandoctor(tmp_path / "ddp", "diagnose", "--json", "r.json", strategy="ddp")
    replicated = json.loads((tmp_path / "ddp" / "r.json").read_text())
    # same seed, same batches: the shards' loss and whole-model gradient norm are DDP's
    for key in ("loss", "grad_norm"):
        ours, theirs = sharded["telemetry"][key], replicated["telemetry"][key]
        assert ours == pytest.approx(theirs, rel=1e-4), key


@pytest.mark.slow
def test_a_run_that_fsdp_casts_to_bfloat16_reports_bfloat16(tmp_path):
    """FSDP's MixedPrecisionPolicy is how FSDP runs train in bfloat16, without autocast:
    the report's dtype is the one forward and backward computed in, not the config's
    float32 (a baseline, a gate and a reader compare runs by it)."""
    extra = ", mixed_precision: {param_dtype: bfloat16}"
    proc = _nandoctor(tmp_path, "diagnose", "--json", "r.json", extra=extra)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert (report["status"], report["environment"]["dtype"]) == ("healthy", "bfloat16")


@pytest.mark.slow
def test_compare_labels_a_run_fsdp_casts_to_bfloat16_as_bfloat16_and_runs_float32_apart(tmp_path):
    """The config's own run computes in its `param_dtype`, bfloat16, and is labelled so
    (it was "float32"); the float32 run asked for drops the cast and is the reference:
    the bfloat16 run drifts from it (two runs both cast to bfloat16 would agree exactly).
    `--dtype bf16` is the config's own run, not run twice."""
    extra = ", mixed_precision: {param_dtype: bfloat16}"
    args = ("compare", "--dtype", "fp32", "--dtype", "bf16", "--json", "compare.json")
    proc = _nandoctor(tmp_path, *args, extra=extra)
    assert proc.returncode == 0, proc.stderr
    comparison = json.loads((tmp_path / "compare.json").read_text())
    runs = comparison["runs"]
    assert [(r["dtype"], r["status"]) for r in runs] == [
        ("bfloat16", "healthy"),
        ("float32", "healthy"),
    ]
    assert comparison["reference"] == "float32"
    assert runs[0]["max_abs_loss_diff_vs_reference"] > 0


@pytest.mark.slow
def test_compare_runs_an_fsdp_config_as_one_job_and_rank_0_writes_it(tmp_path):
    proc = _nandoctor(tmp_path, "compare", "--dtype", "bf16", "--json", "compare.json")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert [(r["dtype"], r["status"], r["steps_completed"]) for r in runs] == [
        ("float32", "healthy", 6),
        ("bfloat16", "healthy", 6),
    ]
