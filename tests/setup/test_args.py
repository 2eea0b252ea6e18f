"""model_args and data_args: YAML 1.1's numeric strings (`1e-5`) reach the builders as
numbers, and the report names each key converted."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.setup.args import numeric_args
from tests.helpers.project import TRAIN_PY

runner = CliRunner()

CODE = (
    TRAIN_PY
    + """

def build_scaled(init=1.0):
    assert isinstance(init, float), f"init is a {type(init).__name__}"
    model = build_model()
    with torch.no_grad():
        model[0].weight.mul_(init * 1e5)
    return model
"""
)

CONFIG = """
model: train.py:build_scaled
model_args: {init: 1e-5}
data: train.py:build_data
data_args: {batches: 4, batch_size: "8"}
optimizer: {name: SGD, lr: 0.1}
precision: {dtype: float32}
steps: 3
device: cpu
"""


def test_numeric_strings_become_numbers_and_other_strings_stay():
    assert numeric_args({"lr": "1e-5", "n": "8", "name": "resnet", "x": 2}) == {
        "lr": 1e-5,
        "n": 8,
        "name": "resnet",
        "x": 2,
    }


def test_the_builders_get_numbers_and_the_report_says_which_keys(project):
    config = project(CONFIG, CODE)
    result = runner.invoke(app, ["diagnose", str(config), "-q", "--json", "-"])
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["notes"]
    hint = "(write 1.0e-5, not 1e-5, for a YAML number)"
    assert f'model_args.init: "1e-5" is text in YAML; passed as the number 1e-05 {hint}' in notes
    assert f'data_args.batch_size: "8" is text in YAML; passed as the number 8 {hint}' in notes
