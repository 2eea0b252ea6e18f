"""Data-parallel runs on the CPU with gloo, two processes launched through torchrun's code:
the report names the step, the phase and the rank where the NaN was born."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from tests.helpers.jobs import run_job

TRAIN = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def build_data(rank, world_size, nan_rank=None, nan_step=None, raise_rank=None, raise_step=None):
    # the documented sharding hook: this rank's own batches
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(8):
        if raise_rank == rank and raise_step == i:
            raise RuntimeError(f"rank {rank} could not read batch {i}")
        x = torch.randn(4, 8, generator=g)
        if nan_rank == rank and nan_step == i:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 3, (4,), generator=g)))
    return out


def rank_aware_data(nan_rank=None, nan_step=None):
    # shards itself: reads its rank from torch.distributed, as many users' loaders do
    import torch.distributed as dist

    return build_data(dist.get_rank(), dist.get_world_size(), nan_rank, nan_step)


def same_data(nan_batch=None):
    # the same 8 batches on every rank: nandoctor splits them by position
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(8):
        x = torch.randn(4, 8, generator=g)
        if i == nan_batch:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 3, (4,), generator=g)))
    return out
"""


def run_two_ranks(
    tmp_path,
    data_args: dict,
    data: str = "build_data",
    *,
    train: str = TRAIN,
    extra: str = "",
    device: str = "cpu",
):
    """`nandoctor diagnose` on two gloo ranks; `extra` is appended to the config."""
    (tmp_path / "train.py").write_text(train)
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: train.py:build_model\ndata: train.py:{data}\n"
        f"data_args: {json.dumps(data_args)}\n"
        "optimizer: {name: SGD, lr: 0.1}\nprecision: {dtype: float32}\nsteps: 10\n"
        f"device: {device}\n" + extra
    )
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "nandoctor", "diagnose", str(config), "--nproc-per-node", "2"]
    proc = run_job([*command, "--json", str(out), "-q"])
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_a_nan_born_on_rank_1_is_named_and_rank_0_inherited_it(tmp_path):
    proc, report = run_two_ranks(tmp_path, {"nan_rank": 1, "nan_step": 5})
    assert proc.returncode == 1, proc.stderr
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["tensor"]) == (5, "input", "input:0")
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert ranks[1]["status"] == "origin" and ranks[1]["first_nonfinite"]["phase"] == "input"
    assert ranks[0]["status"] == "inherited" and ranks[0]["first_nonfinite"]["phase"] == "backward"
    inherited = "born on rank 1 (rank 0 inherited it as the gradients were combined)"
    assert inherited in report["summary"]
    assert report["causes"][0]["id"] == "nonfinite-input"
    assert report["environment"]["data_sharding"] == "self"  # its rank/world_size parameters


@pytest.mark.slow
def test_a_loader_that_shards_itself_fails_at_the_step_the_job_fails(tmp_path):
    # rank 1's own batch 5 holds the NaN: the job fails at step 5 (not at 2, where a
    # second split by position would put it)
    proc, report = run_two_ranks(tmp_path, {"nan_rank": 1, "nan_step": 5}, "rank_aware_data")
    assert proc.returncode == 1, proc.stderr
    assert report["environment"]["data_sharding"] == "self"
    assert (report["first_nonfinite"]["step"], report["first_nonfinite"]["phase"]) == (5, "input")
    ranks = {r["rank"]: r["status"] for r in report["ranks"]}
    assert ranks == {0: "inherited", 1: "origin"}


@pytest.mark.slow
def test_the_same_data_on_every_rank_is_split_by_position(tmp_path):
    # batch 5 goes to rank 1 (5 % 2) as its third batch: step 2
    proc, report = run_two_ranks(tmp_path, {"nan_batch": 5}, "same_data")
    assert proc.returncode == 1, proc.stderr
    assert report["environment"]["data_sharding"] == "by-position"
    assert report["first_nonfinite"]["step"] == 2
    assert {r["rank"]: r["status"] for r in report["ranks"]}[1] == "origin"


@pytest.mark.slow
def test_a_healthy_two_rank_run(tmp_path):
    proc, report = run_two_ranks(tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    assert report["status"] == "healthy" and report["steps_completed"] == 10
    assert [r["status"] for r in report["ranks"]] == ["clean", "clean"]


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_with_exit_3_and_its_error(tmp_path):
    proc, report = run_two_ranks(tmp_path, {"raise_rank": 1, "raise_step": 3})
    assert proc.returncode == 3
    assert (
        "rank 1: data (train.py:build_data) raised RuntimeError: rank 1 could not read batch 3"
        in proc.stderr
    )
    assert report is None  # no half-written report


def test_a_backend_no_rank_can_run_is_refused_once_before_the_ranks_start(tmp_path):
    """nccl on the CPU: every rank met it before any could say another had (two lines)."""
    proc, report = run_two_ranks(tmp_path, {}, extra="distributed: {backend: nccl}\n")
    assert proc.returncode == 2 and report is None
    assert proc.stderr.count("nccl needs CUDA devices") == 1, proc.stderr
    assert "config.yaml:8: distributed.backend: nccl needs CUDA devices" in proc.stderr
    assert "error: rank" not in proc.stderr  # no rank was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_where_there_is_none_is_refused_as_in_one_process(tmp_path):
    # not a run on the CPU that passes as healthy: a CI gate would pass a GPU job never run
    proc, report = run_two_ranks(tmp_path, {}, device="cuda")
    assert proc.returncode == 2 and report is None
    assert "config.yaml:7: device: 'cuda' asked for, but torch.cuda.is_available() is False" in (
        proc.stderr
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_distributed_run_places_its_ranks_itself():
    from nandoctor.errors import ConfigError
    from nandoctor.setup import distributed
    from nandoctor.setup.schema import DistributedConfig

    with pytest.raises(ConfigError, match="each rank runs on cuda:<its local rank>"):
        distributed.check_backend(DistributedConfig(), "cuda:0")


HANG_LOSS = """

import time
import torch.nn.functional as F

_calls = 0


def hanging_loss(model, batch, rank="0"):
    global _calls
    _calls += 1
    if os.environ.get("RANK") == rank and _calls == 3:
        time.sleep(600)  # the rank stops calling collectives: a stuck data source, say
    x, y = batch
    return F.cross_entropy(model(x), y)


def rank_1_hangs(model, batch):
    return hanging_loss(model, batch, rank="1")
"""


@pytest.mark.slow
def test_a_hung_rank_0_is_reported_as_the_failed_job_it_is_not_as_interrupted(tmp_path):
    """Rank 1 times out waiting for rank 0 and fails; the launcher then stops rank 0 with
    SIGTERM, which alone reads as a cancelled job. Rank 1 tells the job's store why, so
    rank 0's report says the job failed, and why (exit 3, as the job's)."""
    train = "import os\n" + TRAIN + HANG_LOSS
    extra = "loss: train.py:hanging_loss\ndistributed: {timeout_s: 5}\n"
    proc, report = run_two_ranks(tmp_path, {}, train=train, extra=extra)
    assert proc.returncode == 3, proc.stderr
    assert "rank 1: another rank hung: no answer within distributed.timeout_s" in proc.stderr
    assert report["status"] == "error"
    assert report["summary"] == "stopped after 2 steps because another rank failed"
    assert report["notes"][-1].startswith(
        "the job's launcher stopped rank 0 after this error: rank 1: another rank hung"
    )


@pytest.mark.slow
def test_a_hung_rank_1_ends_rank_0s_run_and_its_report_says_why(tmp_path):
    """Rank 0, which reports for the job, times out waiting for rank 1: its run ends there
    (status "error", exit 3), judged on the steps done, and the report says which wait
    timed out (there was no report at all)."""
    train = "import os\n" + TRAIN + HANG_LOSS
    extra = "loss: train.py:rank_1_hangs\ndistributed: {timeout_s: 5}\n"
    proc, report = run_two_ranks(tmp_path, {}, train=train, extra=extra)
    assert proc.returncode == 3, proc.stderr
    assert report is not None and report["status"] == "error", proc.stderr
    assert report["steps_completed"] == 2 and report["first_nonfinite"] is None
    assert report["summary"].startswith(
        "rank 0: another rank hung: no answer within distributed.timeout_s during "
    )
    assert "died" not in proc.stderr


AGREE_SCRIPT = """
import os
import types
import torch
import torch.distributed as dist
from torch import nn
import nandoctor.runtime.snapshot as snapshot
from nandoctor.setup.distributed import Ranks

dist.init_process_group("gloo")
rank = dist.get_rank()
ranks = Ranks(rank, 2, rank, torch.device("cpu"))
model = nn.Linear(8, 4 if rank == 0 else 6)  # unequal states, as uneven shards are
optimizer = torch.optim.Adam(model.parameters())
objects = types.SimpleNamespace(
    model=model, optimizer=optimizer, scaler=None, scheduler=None, device=torch.device("cpu"),
    others=[], optimizers=[optimizer], params=list(model.parameters()),
)
# one step between snapshots per 20 bytes: the ranks' states ask for periods within bounds
snapshot.AUTO_BYTES_PER_STEP = 20
alone = snapshot.SnapshotStore(objects)
agreed = snapshot.SnapshotStore(objects, agree=ranks.largest)
for step in range(3):
    batch = torch.randn(2, 8)
    alone.before_step(step, batch)
    agreed.before_step(step, batch)
    model(batch).sum().backward()
    optimizer.step()
print(f"rank {rank}: alone {alone.every}, agreed {agreed.every}", flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)  # NB: see the FSDP snapshot test: gloo's teardown may abort on a loaded machine
"""


AGREED = r"rank (\d): alone (\d+), agreed (\d+)"


@pytest.mark.slow
def test_ranks_whose_states_differ_in_size_snapshot_at_the_same_steps(tmp_path):
    """Each rank's `auto` period follows its own state (FSDP's shards are uneven) and
    batches; ranks snapshotting at different steps would rewind a replay to different
    steps, and its collectives would hang. Every rank takes the largest period."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE_SCRIPT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = run_job([*launch, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # NB: read wherever each rank's line landed (two processes share one stdout)
    said = {r: (int(a), int(b)) for r, a, b in re.findall(AGREED, proc.stdout)}
    assert set(said) == {"0", "1"}, proc.stdout
    (alone0, agreed0), (alone1, agreed1) = said["0"], said["1"]
    assert alone0 < alone1  # the ranks' own periods differ...
    assert agreed0 == agreed1 == alone1  # ...and both take the larger
