"""The bad-input matrix: every broken config, entrypoint, data, loss, checkpoint or path
gets one clear message naming what is wrong and SPEC's exit code, never a traceback, and
never a partial report file."""

from __future__ import annotations

import textwrap

import pytest
import torch
from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.project import TRAIN_PY

runner = CliRunner()

EXTRA = """
import torch
def a_float(model, batch):
    return 3.0
def per_sample(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")
def strings():
    return ["a", "b"]
def wrong_width():
    return [(torch.randn(4, 5), torch.randint(0, 3, (4,)))]
def a_dict():
    return {"a": 1}
def no_params():
    return torch.nn.ReLU()
def no_return(model, batch):
    x, y = batch
    torch.nn.functional.cross_entropy(model(x), y)
class Output:  # transformers' ModelOutput, as far as a loss function sees it
    def __init__(self, loss):
        self.loss = loss
def labelled():
    return [{"x": torch.randn(4, 8), "labels": torch.randint(0, 3, (4,))}]
def unlabelled():
    return [{"x": torch.randn(4, 8)}]
def model_output(model, batch):
    out = model(batch["x"])
    return Output(torch.nn.functional.cross_entropy(out, batch["labels"]))
def output_loss(model, batch):
    model(batch["x"])
    return Output(None).loss
def samples():  # a map-style dataset, not wrapped in a DataLoader
    return torch.utils.data.TensorDataset(torch.randn(4, 8), torch.randint(0, 3, (4,)))
def make_sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr)
def optimizer_as_a_dict(params):
    return {"params": params}
def sgd_of_other_weights(params):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
def scheduler_as_a_dict(optimizer):
    return {"optimizer": optimizer}
class TupleOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)
    def forward(self, x):
        return self.linear(x), x
"""

BASE = """\
model: train.py:build_model
data: train.py:build_data
optimizer: {name: SGD, lr: 0.1}
precision: {dtype: float32}
steps: 3
device: cpu
"""


class Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "extra.py").write_text(textwrap.dedent(EXTRA))
    (tmp_path / "corrupt.pt").write_bytes(b"these bytes are no checkpoint")
    torch.save({"model": Evil()}, tmp_path / "evil.pt")
    torch.save({"model": {"other.weight": torch.ones(1)}}, tmp_path / "wrong.pt")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    adam = torch.optim.Adam(model.parameters())  # NB: the config's optimizer is SGD
    torch.save({"model": model.state_dict(), "optimizer": adam.state_dict()}, tmp_path / "adam.pt")
    return tmp_path


CASES = [
    # (name, config text, exit code, expected message fragment)
    ("yaml does not parse", "model: [x\n", 2, ":2:1: the YAML does not parse:"),
    ("a list", "- a\n- b\n", 2, "expected a mapping of keys"),
    ("empty", "", 2, "the config is empty"),
    ("wrong type", BASE + "seed: abc\n", 2, ":7: seed: expected a valid integer"),
    ("unknown key", BASE + "optimiser: 1\n", 2, ":7: unknown key 'optimiser'; did you mean 'optimizer'?"),
    ("zero steps", BASE.replace("steps: 3", "steps: 0"), 2, "steps: expected a value greater than 0"),
    ("negative steps", BASE.replace("steps: 3", "steps: -2"), 2, "steps: expected a value greater than 0"),
    ("unknown dtype", BASE.replace("float32", "float8"), 2, "precision.dtype: unknown dtype 'float8'"),
    ("optimizer as a name", BASE.replace("{name: SGD, lr: 0.1}", "SGD"), 2, ":3: optimizer: expected a mapping of keys; got 'SGD': write {name: SGD}"),
    ("precision as a dtype", BASE.replace("{dtype: float32}", "float32"), 2, ":4: precision: expected a mapping of keys; got 'float32'\n"),
    ("unknown optimizer", BASE.replace("SGD", "Adamw"), 2, "has no class 'Adamw'; did you mean 'AdamW'?"),
    ("optimizer kwargs", BASE.replace("lr: 0.1", "lr: 0.1, bogus: 2"), 2, "unexpected keyword argument 'bogus'"),
    ("optimizer value", BASE.replace("lr: 0.1", "lr: -1"), 2, "Invalid learning rate"),
    # NB: True is 1 to Python: `lr: on` trained at a rate of 1, silently
    ("a boolean for a rate", BASE.replace("lr: 0.1", "lr: on"), 2, "optimizer.lr: expected a number, got true (YAML reads yes, no, on, off as booleans)"),
    ("a boolean for a momentum", BASE.replace("lr: 0.1", "lr: 0.1, momentum: yes"), 2, "optimizer.momentum: expected a number, got true"),
    ("a boolean for a step size", BASE + "scheduler: {name: StepLR, step_size: yes}\n", 2, "scheduler.step_size: expected a number, got true"),
    ("a boolean for a factory's number", BASE.replace("{name: SGD, lr: 0.1}", "{factory: 'extra.py:make_sgd', lr: off}"), 2, "optimizer.lr: expected a number, got false"),
    # NB: each trained nothing, silently, or broke every weight at step 0 with no cause named
    ("a NaN rate", BASE.replace("lr: 0.1", "lr: .nan"), 2, "config.yaml:3: optimizer.lr: expected a finite number, got nan"),
    ("an infinite rate", BASE.replace("lr: 0.1", "lr: .inf"), 2, "optimizer.lr: expected a finite number, got inf"),
    ("a NaN weight decay", BASE.replace("{name: SGD, lr: 0.1}", "{name: AdamW, lr: 0.1, weight_decay: .nan}"), 2, "optimizer.weight_decay: expected a finite number, got nan"),
    ("a NaN beta", BASE.replace("{name: SGD, lr: 0.1}", "{name: AdamW, betas: [0.9, .nan]}"), 2, "optimizer.betas: expected a finite number, got [0.9, nan]"),
    ("an infinite loss scale", BASE.replace("{dtype: float32}", "{dtype: float16, init_scale: .inf}"), 2, "precision.init_scale: expected a finite number; got inf"),
    ("an optimizer factory's dict", BASE.replace("{name: SGD, lr: 0.1}", "{factory: 'extra.py:optimizer_as_a_dict'}"), 2, "optimizer: extra.py:optimizer_as_a_dict returned a dict, expected a torch.optim.Optimizer"),
    ("an optimizer of other weights", BASE.replace("{name: SGD, lr: 0.1}", "{factory: 'extra.py:sgd_of_other_weights'}"), 2, "optimizer: extra.py:sgd_of_other_weights holds none of the model's trainable parameters"),
    ("a scheduler factory's dict", BASE + "scheduler: {factory: 'extra.py:scheduler_as_a_dict'}\n", 2, "scheduler: extra.py:scheduler_as_a_dict returned a dict, expected a learning rate scheduler"),
    ("the schedulers' base class", BASE + "scheduler: {name: LRScheduler}\n", 2, "scheduler.name: LRScheduler is the base class of torch.optim.lr_scheduler's classes, not one of them"),
    ("missing file", BASE.replace("train.py:build_model", "nope.py:f"), 2, "model: 'nope.py:f': file not found"),
    ("missing module", BASE.replace("train.py:build_model", "nopkg_xyz.m:f"), 2, "no module named 'nopkg_xyz'"),
    ("missing attribute", BASE.replace("train.py:build_model", "train.py:nothing"), 2, "has no attribute 'nothing'"),
    ("not callable", BASE.replace("train.py:build_model", "train.py:NOT_CALLABLE"), 2, "is an int, expected a callable"),
    ("model_args misspelt", BASE + "model_args: {featurs: 8}\n", 2, "model_args: train.py:build_model(features=8, classes=3) got an unexpected keyword argument 'featurs'"),
    ("data_args misspelt", BASE + "data_args: {batchez: 2}\n", 2, "data_args: train.py:build_data("),
    ("an argument named as ours", BASE + "model_args: {name: a, key: b}\n", 2, "unexpected keyword argument 'name'"),
    ("factory kwargs", BASE.replace("{name: SGD, lr: 0.1}", "{factory: 'extra.py:make_sgd', lrr: 1}"), 2, "optimizer: extra.py:make_sgd(params, lr=0.1) got an unexpected keyword argument 'lrr'"),
    ("model returns a tuple", BASE.replace("train.py:build_model", "extra.py:TupleOut"), 2, "loss: the default loss expects model(x) to return a tensor of logits; it returned a tuple"),
    ("builder raises", BASE.replace("train.py:build_model", "train.py:raises"), 3, "raised RuntimeError: the user's builder broke"),
    ("not a module", BASE.replace("train.py:build_model", "extra.py:a_dict"), 2, "returned a dict, expected a torch.nn.Module"),
    ("no parameters", BASE.replace("train.py:build_model", "extra.py:no_params"), 2, "no trainable parameters"),
    ("empty data", BASE.replace("train.py:build_data", "train.py:no_data"), 2, "data: yielded no batches"),
    ("data not iterable", BASE.replace("train.py:build_data", "train.py:not_iterable"), 2, "expected an iterable of batches"),
    ("a dataset of samples", BASE.replace("train.py:build_data", "extra.py:samples"), 2, "data: returned a TensorDataset, a dataset of samples; expected batches\nhint: return torch.utils.data.DataLoader(dataset, batch_size=...)"),
    ("non-tensor batches", BASE.replace("train.py:build_data", "extra.py:strings"), 2, "default loss expects batches (x, y); got a str"),
    ("mismatched shapes", BASE.replace("train.py:build_data", "extra.py:wrong_width"), 3, "loss (step 0) raised RuntimeError: mat1 and mat2 shapes"),
    ("loss not a tensor", BASE + "loss: extra.py:a_float\n", 2, "loss: returned a float, expected a scalar torch.Tensor\nhint: return the loss tensor, not `loss.item()`"),
    ("loss returns nothing", BASE + "loss: extra.py:no_return\n", 2, "loss: returned None, expected a scalar torch.Tensor\nhint: the loss function returned nothing: end it with `return loss`"),
    ("loss returns the model's output", BASE.replace("train.py:build_data", "extra.py:labelled") + "loss: extra.py:model_output\n", 2, "hint: that is the model's output: return its .loss (`model(**batch).loss`)"),
    ("a transformers loss without labels", BASE.replace("train.py:build_data", "extra.py:unlabelled") + "loss: extra.py:output_loss\n", 2, "hint: a transformers model's .loss is None unless the batch holds 'labels'; this batch holds 'x'"),
    ("loss not a scalar", BASE + "loss: extra.py:per_sample\n", 2, "expected a scalar"),
    ("checkpoint missing", BASE + "checkpoint: none.pt\n", 2, "checkpoint: file not found"),
    ("checkpoint a folder", BASE + "checkpoint: .\n", 2, "is a folder, expected a checkpoint file"),
    ("checkpoint a device", BASE + "checkpoint: /dev/null\n", 2, "checkpoint: /dev/null is not a regular file, expected a checkpoint file"),
    ("python_path missing", BASE + "python_path: [no/such/dir]\n", 2, "python_path: 'no/such/dir': folder not found"),
    ("python_path a file", BASE + "python_path: [train.py]\n", 2, "python_path: 'train.py': is not a folder"),
    ("checkpoint corrupt", BASE + "checkpoint: corrupt.pt\n", 2, "is not a readable torch checkpoint"),
    ("checkpoint with code", BASE + "checkpoint: evil.pt\n", 2, "holds pickled code or objects (print), which torch.load(weights_only=True) refuses"),
    ("checkpoint mismatch", BASE + "checkpoint: wrong.pt\n", 2, "checkpoint: does not fit the model"),
    # NB: torch loads it (the group sizes match) and SGD's first step raised KeyError 'momentum'
    ("another optimizer's state", BASE + "checkpoint: adam.pt\n", 2, "checkpoint: 'optimizer' does not fit the optimizer: it holds 'amsgrad', 'betas', 'capturable', ..., which SGD does not take, and lacks SGD's 'dampening', 'momentum', 'nesterov': it was saved by another optimizer"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "code", "message"), CASES, ids=[c[0] for c in CASES])
def test_each_bad_input_gets_one_clear_message_and_its_exit_code(folder, name, text, code, message):
    (folder / "config.yaml").write_text(text)
    out = folder / "report.json"
    result = runner.invoke(app, ["diagnose", str(folder / "config.yaml"), "--json", str(out), "-q"])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert "Traceback (most recent call last)" not in result.output
    assert "this must never run" not in result.output
    assert not out.exists()  # no partial report
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp file


def test_cuda_without_cuda(folder):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (folder / "config.yaml").write_text(BASE.replace("device: cpu", "device: cuda"))
    result = runner.invoke(app, ["diagnose", str(folder / "config.yaml")])
    assert result.exit_code == 2 and "torch.cuda.is_available() is False" in result.output


def test_bfloat16_on_a_gpu_without_it(folder, monkeypatch):
    from nandoctor.setup import devices

    monkeypatch.setattr(devices, "_cuda_bf16", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(devices.ConfigError, match="bfloat16 is not supported on Tesla V100"):
        devices.check_dtype_supported(torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("where", ["missing/dir/report.json", "readonly/report.json"])
def test_a_report_path_that_cannot_be_written(folder, where):
    (folder / "readonly").mkdir(mode=0o500)
    (folder / "config.yaml").write_text(BASE)
    result = runner.invoke(
        app, ["diagnose", str(folder / "config.yaml"), "--json", str(folder / where)]
    )
    if where.startswith("readonly") and result.exit_code == 0:
        pytest.skip("running as a user who can write anywhere (root)")
    assert result.exit_code == 2 and "--json" in result.output


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("new/", "ends in a folder, expected a file path"),  # it wrote a file named new
        ("config.yaml/report.json", "config.yaml is a file, not a folder"),
    ],
)
def test_a_report_path_that_names_no_file_is_refused_as_what_it_is(folder, path, message):
    (folder / "config.yaml").write_text(BASE)
    report = f"{folder}/{path}"  # NB: as typed: a Path would drop the trailing slash
    result = runner.invoke(app, ["diagnose", str(folder / "config.yaml"), "--json", report])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (folder / "new").exists()


def invoke_on_a_project(folder, args: list[str]):
    """`args` run on a healthy config and its train.py in `folder` ({config}, {train})."""
    (folder / "config.yaml").write_text(BASE)
    (folder / "train.py").write_text(TRAIN_PY)
    args = [a.format(config=folder / "config.yaml", train=folder / "train.py") for a in args]
    return args, runner.invoke(app, args)


@pytest.mark.parametrize(
    "args",
    [
        ["diagnose", "{config}", "--json", ""],
        ["diagnose", "{config}", "--junit", ""],
        ["diagnose", "{config}", "--markdown", ""],
        ["diagnose", "{config}", "--tensorboard", ""],
        ["diagnose", "{config}", "--baseline", ""],
        ["baseline", "{config}", "--out", ""],
        ["compare", "{config}", "--json", ""],
        ["lint", "{train}", "--sarif", ""],
    ],
)
def test_an_empty_report_path_is_refused_before_the_run(folder, args):
    """`--json "$REPORT"` with the variable unset: the job must not pass without its
    report (it was silently not written), nor fail only after the whole run."""
    args, result = invoke_on_a_project(folder, args)
    assert result.exit_code == 2, result.output
    option = args[-2]
    assert f"error: {option}: expected a" in result.output, result.output
    assert "got an empty string" in result.output
    assert "HEALTHY" not in result.output  # refused before the run


@pytest.mark.parametrize(
    "args",
    [
        ["diagnose", "{config}", "--junit", "--fail-on-divergence"],
        ["diagnose", "{config}", "--json", "--quiet"],
        ["diagnose", "{config}", "--tensorboard", "--fail-on-divergence"],
        ["baseline", "{config}", "--out", "--quiet"],
        ["compare", "{config}", "--markdown", "--quiet"],
        ["lint", "{train}", "--sarif", "--quiet"],
    ],
)
def test_an_option_taken_for_a_report_path_is_refused_before_the_run(folder, args, monkeypatch):
    """`--junit $REPORT --fail-on-divergence` with REPORT unset and unquoted: the option
    became the report's path, and the job lost its gate and passed (exit 0)."""
    monkeypatch.chdir(folder)
    args, result = invoke_on_a_project(folder, args)
    assert result.exit_code == 2, result.output
    option, value = args[-2:]
    assert f"error: {option}: got the option '{value}' where a path was expected" in result.output
    assert "HEALTHY" not in result.output
    assert not (folder / value).exists()


def test_a_folder_that_refuses_new_files_is_found_before_the_run(folder):
    """/proc passes every permission check as root, yet creates no file: only trying
    tells (the report was lost after a whole run)."""
    (folder / "config.yaml").write_text(BASE)
    result = runner.invoke(app, ["diagnose", str(folder / "config.yaml"), "--json", "/proc/r.json"])
    assert result.exit_code == 2
    assert "error: --json /proc/r.json: folder /proc is not writable" in result.output
    assert "HEALTHY" not in result.output
