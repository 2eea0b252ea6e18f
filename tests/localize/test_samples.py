"""Name the sample: `first_nonfinite.samples` lists the rows of the batch the failure began
in (a batch row that holds NaN, or one whose values make a forward op non-finite), with
each row's dataset index where the data is a DataLoader over a map-style dataset."""

from __future__ import annotations

import io
import itertools

import pytest
from rich.console import Console

from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.localize import samples as search
from nandoctor.localize.finding import Sighting
from nandoctor.render.markdown import render_markdown
from nandoctor.render.origin import samples_text
from nandoctor.render.terminal import render_report
from nandoctor.report.types import Report, Sample
from nandoctor.runtime.probe import Phase
from nandoctor.setup.load import load_config
from tests.helpers.project import base_config

TRAIN = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Documents(Dataset):
    '''Word counts of documents; document `empty` has none, document `corrupt` a NaN.'''

    def __init__(self, size=64, empty=None, corrupt=None, as_dict=False):
        g = torch.Generator().manual_seed(3)
        self.x = torch.rand(size, 16, generator=g) + 0.1
        self.y = torch.randint(0, 3, (size,), generator=g)
        if empty is not None:
            self.x[empty] = 0.0
        if corrupt is not None:
            self.x[corrupt, 5] = float("nan")
        self.as_dict = as_dict

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.as_dict:
            return {"counts": self.x[i], "label": self.y[i]}
        return self.x[i], self.y[i]


class Frequencies(nn.Module):
    '''Each document's counts as frequencies (an empty document's: 0 / 0), classified.
    `seq_first`: the counts in 4 groups of 4, the groups first, as a sequence model
    lays them out.'''

    def __init__(self, seq_first=False):
        super().__init__()
        self.seq_first = seq_first
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x):
        if self.seq_first:
            groups = x.reshape(len(x), 4, 4).transpose(0, 1)
            freq = groups / x.sum(-1)[None, :, None]
            return self.net(freq.transpose(0, 1).reshape(len(x), 16))
        return self.net(x / x.sum(-1, keepdim=True))


def build_model(seq_first=False):
    return Frequencies(seq_first)


def build_loader(empty=None, corrupt=None, as_dict=False, workers=0):
    return DataLoader(
        Documents(empty=empty, corrupt=corrupt, as_dict=as_dict), batch_size=16, shuffle=True,
        generator=torch.Generator().manual_seed(7), num_workers=workers,
    )


def loss(model, batch):
    x, y = (batch["counts"], batch["label"]) if isinstance(batch, dict) else batch
    return F.cross_entropy(model(x), y)
"""


def run(project, tmp_path, model_args=None, **data_args) -> Report:
    path = project(
        base_config(
            model="train.py:build_model",
            model_args=model_args or {},
            data="train.py:build_loader",
            data_args=data_args,
            loss="train.py:loss",
            steps=20,
        ),
        code=TRAIN,
    )
    return diagnose(load_config(path), DiagnoseOptions(verify=False))


def where_the_loader_puts(item: int) -> tuple[int, int]:
    """(step, row) of `item` in the user's own iteration of the loader: the loader shuffles
    with its own seeded generator, as the module above builds it."""
    import torch
    from torch.utils.data import DataLoader

    loader = DataLoader(
        range(64), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    for step, batch in enumerate(itertools.chain(loader, loader)):
        if item in batch.tolist():
            return step, batch.tolist().index(item)
    raise AssertionError(item)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_item_is_named_by_its_row_and_its_dataset_index(project, tmp_path, workers):
    report = run(project, tmp_path, corrupt=41, workers=workers)
    first = report.first_nonfinite
    step, row = where_the_loader_puts(41)
    assert (first.step, first.phase, first.tensor) == (step, "input", "input:0")
    assert first.samples == [Sample(row=row, index=41, nonfinite=1)]


def test_with_accumulation_the_row_is_the_micro_batchs(project, tmp_path):
    path = project(
        base_config(
            model="train.py:build_model",
            data="train.py:build_loader",
            data_args={"corrupt": 41},
            loss="train.py:loss",
            steps=10,
            grad_accum_steps=2,
        ),
        code=TRAIN,
    )
    first = diagnose(load_config(path), DiagnoseOptions(verify=False)).first_nonfinite
    batch, row = where_the_loader_puts(41)
    assert (first.step, first.micro_batch) == (batch // 2, batch % 2)
    assert first.samples == [Sample(row=row, index=41, nonfinite=1)]


def test_a_dict_batch_names_its_row_too(project, tmp_path):
    report = run(project, tmp_path, corrupt=41, as_dict=True)
    step, row = where_the_loader_puts(41)
    assert (report.first_nonfinite.step, report.first_nonfinite.tensor) == (step, "input:counts")
    assert report.first_nonfinite.samples == [Sample(row=row, index=41, nonfinite=1)]


def test_a_forward_op_one_document_makes_non_finite_names_that_document(project, tmp_path):
    """The empty document's 0 / 0 is born in the model's forward: the row whose values
    make the division non-finite, found by running the step on that row alone."""
    report = run(project, tmp_path, empty=9)
    first = report.first_nonfinite
    step, row = where_the_loader_puts(9)
    assert (first.step, first.phase, first.op, first.module) == (
        step,
        "forward",
        "aten.div.Tensor",
        "",
    )
    assert first.samples == [Sample(row=row, index=9, nonfinite=16)]


def test_rows_the_op_lays_out_elsewhere_are_found_by_bisecting_the_batch(project, tmp_path):
    """The division's output has the groups first ([4, 16, 4]): its rows are not the
    batch's, and the runs on halves of the batch find the document."""
    report = run(project, tmp_path, model_args={"seq_first": True}, empty=9)
    step, row = where_the_loader_puts(9)
    assert report.first_nonfinite.step == step
    assert report.first_nonfinite.samples == [Sample(row=row, index=9, nonfinite=16)]


def test_a_batch_of_lists_has_rows_but_no_dataset_index(project, tmp_path):
    path = project(base_config(data="train.py:build_data", data_args={"nan_at": 2}, steps=4))
    report = diagnose(load_config(path), DiagnoseOptions(verify=False))
    assert report.first_nonfinite.samples == [Sample(row=0, index=None, nonfinite=1)]


def test_one_empty_document_in_a_bert_batch_is_named(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers import sample_models

    path = tmp_path / "bert.yaml"
    path.write_text(
        "model: tests.helpers.sample_models:bert\n"
        "data: tests.helpers.sample_models:documents\n"
        "loss: tests.helpers.sample_models:mean_pooled_loss\n"
        "optimizer: {name: AdamW, lr: 1.0e-3}\n"
        "precision: {dtype: float32}\n"
        "steps: 12\n"
        "device: cpu\n"
    )
    report = diagnose(load_config(path), DiagnoseOptions(verify=False))
    first = report.first_nonfinite
    loader = sample_models.documents()
    step, row = next(
        (step, row)
        for step, batch in enumerate(loader)
        for row, ids in enumerate(batch["attention_mask"])
        if not ids.any()
    )
    assert (first.step, first.phase, first.op, first.module) == (
        step,
        "loss",
        "aten.div.Tensor",
        None,
    )
    assert first.samples == [Sample(row=row, index=sample_models.EMPTY, nonfinite=32)]


# -- the search itself, on a stand-in for the reruns ----------------------------------
def finding(shape, rows=()) -> Sighting:
    return Sighting(Phase.FORWARD, "", "aten.div.Tensor", "output", "nan", "float32",
                   list(shape), sum(n for _, n in rows), None, rows=tuple(rows))  # fmt: skip


class Reruns(search._Search):
    """The search, with each run's outcome told by `makes(rows)` instead of a step."""

    def __init__(self, size, makes):
        self.size, self.runs, self.makes = size, 0, makes

    def made(self, rows):
        if self.runs == search.MAX_RUNS:
            raise search._Unknown
        self.runs += 1
        return self.makes(rows)


def each_row(bad: dict[int, int]):
    return lambda rows: sum(bad.get(r, 0) for r in rows)


def test_candidates_are_confirmed_in_two_runs():
    runs = Reruns(16, each_row({5: 3}))
    assert runs.confirmed(search._candidates(finding([16, 8], [(5, 3)]), 16)) == {5: 3}
    assert runs.runs == 2


def test_candidates_from_flattened_rows_count_per_sample():
    # a [16, 12] batch's tokens flattened to [192, V]: rows 60 and 62 are sample 5's
    assert search._candidates(finding([192, 8], [(60, 1), (62, 2)]), 16) == {5: 3}


def test_candidates_other_rows_also_make_non_finite_are_not_confirmed():
    runs = Reruns(16, each_row({5: 3, 9: 1}))
    assert runs.confirmed({5: 3}) is None


def test_bisection_finds_each_row_that_makes_it_alone():
    runs = Reruns(16, each_row({2: 1, 11: 4}))
    assert runs.bisected() == {2: 1, 11: 4}
    assert runs.runs <= 2 * 2 * 4  # two rows, four halvings each


def test_rows_that_make_it_only_together_are_not_named():
    runs = Reruns(16, lambda rows: 1 if {3, 12} <= set(rows) else 0)  # a batch statistic
    with pytest.raises(search._Unknown):
        runs.bisected()


def test_the_runs_are_bounded():
    runs = Reruns(64, lambda rows: len(rows))  # every row alone: 126 runs to prove it
    with pytest.raises(search._Unknown):
        runs.bisected()
    assert runs.runs == search.MAX_RUNS


# -- how the reports say it -----------------------------------------------------------
def test_the_terminal_says_which_sample_and_its_dataset_index():
    assert samples_text([Sample(17, 1843, 1)]) == "sample 17 of the batch (dataset index 1843)"
    assert (
        samples_text([Sample(3, None, 1), Sample(17, None, 2)]) == "samples 3 and 17 of the batch"
    )
    many = [Sample(r, r + 100, 1) for r in range(8)]
    assert samples_text(many) == (
        "samples 0, 1, 2, 3, 4 and 3 more of the batch "
        "(dataset indices 100, 101, 102, 103, 104 and 3 more)"
    )
    assert samples_text([]) is None


def test_the_sample_is_in_the_terminal_markdown_and_json(project, tmp_path):
    report = run(project, tmp_path, corrupt=41)
    _, row = where_the_loader_puts(41)
    said = f"sample {row} of the batch (dataset index 41)"
    console = Console(file=io.StringIO(), width=200)
    render_report(console, report)
    assert said in console.file.getvalue()
    assert said in render_markdown(report)
    data = report.to_dict()["first_nonfinite"]
    assert data["samples"] == [{"row": row, "index": 41, "nonfinite": 1}]
    assert (
        Report.from_dict(report.to_dict()).first_nonfinite.samples == report.first_nonfinite.samples
    )


def test_a_guarded_loop_names_the_document_by_rerunning_its_own_step():
    """`guard.step` keeps the user's step function and its arguments: the reruns slice
    the arguments' rows (a keyword batch here), and call the step again."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from nandoctor.guard import Guard, NonFiniteError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.rand(8, 16, generator=g) + 0.1, torch.randint(0, 3, (8,), generator=g))]
    batches *= 4
    counts = batches[3][0].clone()
    counts[6] = 0.0  # an empty document
    batches[3] = (counts, batches[3][1])

    def train_step(*, counts, labels):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(counts / counts.sum(-1, keepdim=True)), labels)
        loss.backward()
        optimizer.step()

    guard = Guard(model, optimizer)
    with pytest.raises(NonFiniteError) as caught:
        for x, y in batches:
            guard.step(train_step, counts=x, labels=y)
    first = caught.value.report.first_nonfinite
    assert (first.step, first.phase, first.op) == (3, "loss", "aten.div.Tensor")
    assert first.samples == [Sample(row=6, index=None, nonfinite=16)]
