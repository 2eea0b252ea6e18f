"""Reading a config: every key has its default, and every mistake is one line naming the
file, the line, the key and what was expected."""

from __future__ import annotations

import random

import pytest
import yaml

from nandoctor.errors import ConfigError
from nandoctor.setup import load as load_module
from nandoctor.setup.entrypoints import resolve
from nandoctor.setup.load import load_config
from tests.helpers.project import TRAIN_PY

MINIMAL = """\
model: train.py:build_model
data: train.py:build_data
optimizer: {name: SGD, lr: 0.1}
"""


def error_of(project, text: str) -> str:
    path = project(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return info.value.message


def test_minimal_config_gets_every_default(project):
    config = load_config(project(MINIMAL)).config
    assert config.model_args == {} and config.data_args == {}
    assert config.loss is None and config.scheduler is None
    assert config.precision.dtype == "float16"
    assert config.precision.use_grad_scaler is True
    assert config.precision.init_scale == 65536.0
    assert config.clip_grad_norm is None
    assert (config.steps, config.device, config.seed, config.checkpoint) == (500, "auto", 0, None)
    assert config.python_path == [] and config.name is None


def test_grad_scaler_defaults_off_outside_float16(project):
    config = load_config(project(MINIMAL + "precision: {dtype: bf16}\n")).config
    assert config.precision.dtype == "bfloat16"
    assert config.precision.use_grad_scaler is False


def test_optimizer_kwargs_pass_through_and_yaml_1_1_numbers_become_numbers(project):
    config = load_config(project(MINIMAL.replace("lr: 0.1", "lr: 3e-4, betas: [0.9, 0.99]")))
    assert config.config.optimizer.kwargs == {"lr": 3e-4, "betas": [0.9, 0.99]}


def test_unknown_key_names_line_and_suggests(project):
    message = error_of(project, MINIMAL + "stesp: 10\n")
    assert message.endswith("config.yaml:4: unknown key 'stesp'; did you mean 'steps'?")


def test_a_misspelt_required_key_is_one_line_the_suggestion(project):
    # it was two, "missing required key 'optimizer'" first
    message = error_of(project, MINIMAL.replace("optimizer:", "optimiser:"))
    assert message.endswith("config.yaml:3: unknown key 'optimiser'; did you mean 'optimizer'?")
    assert "\n" not in message
    # a key missing in its own right is still said
    message = error_of(project, "model: train.py:build_model\noptimiser: {name: SGD}\n")
    assert "missing required key 'data'" in message and "missing required key 'optimizer'" not in (
        message
    )


def test_unknown_nested_key_is_dotted(project):
    message = error_of(project, MINIMAL + "precision:\n  dtype: float16\n  init_scal: 2.0\n")
    assert message.endswith(":6: unknown key 'precision.init_scal'; did you mean 'init_scale'?")


def test_wrong_type_names_key_line_and_value(project):
    message = error_of(project, MINIMAL + "steps: many\n")
    assert ":4: steps: expected a valid integer" in message
    assert "'many'" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("steps: 0", "steps: expected a value greater than 0; got 0"),
        ("steps: -5", "steps: expected a value greater than 0; got -5"),
        ("clip_grad_norm: no", "clip_grad_norm: expected a number (YAML reads yes, no, on, off"),
        ("precision: {dtype: float8}", "precision.dtype: unknown dtype 'float8'"),
        ("device: tpu", "device: expected auto, cpu, cuda or cuda:N"),
        ("seed: -1", "seed: expected a value greater than or equal to 0"),
    ],
)
def test_bad_values(project, line, expected):
    assert expected in error_of(project, MINIMAL + line + "\n")


def test_missing_required_key(project):
    message = error_of(project, "model: train.py:build_model\noptimizer: {name: SGD, lr: 1}\n")
    assert message.endswith("missing required key 'data'")


def test_entrypoint_syntax(project):
    message = error_of(project, MINIMAL.replace("train.py:build_model", "build_model"))
    assert ":1: model: expected an entrypoint 'package.module:attribute'" in message


def test_a_relative_module_is_a_config_error_not_the_users_code(project):
    # importlib raised TypeError for it: exit 3 with importlib's frame as "your code"
    message = error_of(project, MINIMAL.replace("train.py:build_model", ".train:build_model"))
    assert "; a module is named from its top package, not relative to the config" in message


def test_a_file_entrypoint_may_have_spaces_in_its_path(project, tmp_path):
    (tmp_path / "Google Drive").mkdir()
    (tmp_path / "Google Drive" / "my train.py").write_text(TRAIN_PY)
    text = MINIMAL.replace("train.py:build_model", "'Google Drive/my train.py:build_model'")
    loaded = load_config(project(text))
    model = resolve(loaded.config.model, "model", loaded.path.parent)
    assert model.__name__ == "build_model"


def test_optimizer_needs_exactly_one_of_name_or_factory(project):
    message = error_of(project, MINIMAL.replace("{name: SGD, lr: 0.1}", "{lr: 0.1}"))
    assert "optimizer: expected exactly one of `name` or `factory`" in message


def test_yaml_that_does_not_parse_gives_line_and_column(project):
    message = error_of(project, "model: [unclosed\n")
    assert ":2:1: the YAML does not parse:" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the config is empty"),
        ("- a\n- b\n", "expected a mapping of keys"),
        ("42\n", "got a int"),
    ],
)
def test_config_that_is_not_a_mapping(project, text, expected):
    assert expected in error_of(project, text)


def test_duplicate_keys_are_refused(project):
    message = error_of(project, MINIMAL + "steps: 1\nsteps: 2\n")
    assert message.endswith(":5: steps: duplicate key (first on line 4)")


def test_several_errors_one_line_each_in_file_order(project):
    message = error_of(project, MINIMAL + "steps: 0\nseed: x\n")
    lines = message.splitlines()
    assert len(lines) == 2
    assert ":4: steps" in lines[0] and ":5: seed" in lines[1]


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_overrides_reach_into_precision(project):
    loaded = load_config(project(MINIMAL)).with_overrides(dtype="bfloat16", steps=3, seed=None)
    assert loaded.config.precision.dtype == "bfloat16"
    assert loaded.config.steps == 3 and loaded.config.seed == 0


def test_a_key_that_looks_like_a_pydantic_validator_name(project):
    """Found by hypothesis: pydantic names validators 'function-after[...]' in locations."""
    message = error_of(project, MINIMAL + "function-: 1\n")
    assert ":4: unknown key 'function-'; expected one of: name, python_path, model" in message


def per_sample_weights(n: int = 260_000) -> list[float]:
    """Weights as a spreadsheet exports them: full float reprs, ~21 bytes each."""
    rng = random.Random(0)
    return [rng.random() for _ in range(n)]


def test_a_config_that_carries_data_is_read(project):
    """260,000 per-sample weights exported into data_args: a 5.4 MB config, and a legal
    one (it was refused: 'the config is 5460322 bytes, more than the limit of 1048576')."""
    weights = per_sample_weights()
    text = MINIMAL + "data_args:\n  weights: [" + ", ".join(map(repr, weights)) + "]\n"
    assert len(text) > 5_000_000
    loaded = load_config(project(text))
    assert loaded.config.data_args["weights"] == weights
    assert loaded.lines[("data_args", "weights")] == 5


def test_aliases_may_reuse_values_but_not_multiply_them(project):
    """What is written out is bounded by the file's size; aliases may add 100,000 values
    to it, no more (a few lines that expand to 10^9 values are an alias bomb)."""
    row = "[" + ", ".join(["1"] * 1000) + "]"
    reused = MINIMAL + f"model_args:\n  rows: &row {row}\n"
    again = "".join(f"  copy{i}: *row\n" for i in range(99))
    assert len(load_config(project(reused + again)).config.model_args) == 100  # +99,000
    message = error_of(project, reused + again + "  copy99: *row\n  copy100: *row\n")
    assert "its aliases expand to more than 100000 values beyond those written out" in message


CORNERS = """\
model: train.py:build_model  # a comment
data: train.py:build_data
base: &base {lr: 0.1, momentum: 0.9}
optimizer:
  <<: *base
  name: SGD
data_args:
  nested: [[1, 2], {a: [3, "4"]}]
  when: 2024-01-02
  text: |
    two
    lines
"""


@pytest.mark.parametrize("reader", ["libyaml", "python"])
def test_both_yaml_readers_read_a_config_alike(project, monkeypatch, reader):
    """libyaml's reader is used where PyYAML has it (10x faster); the pure-Python one
    where it has not: the same data, the same lines, the same messages."""
    if reader == "libyaml" and not getattr(yaml, "__with_libyaml__", False):
        pytest.skip("PyYAML was built without libyaml here")
    monkeypatch.setattr(
        load_module, "_LOADER", yaml.CSafeLoader if reader == "libyaml" else yaml.SafeLoader
    )
    path = project(CORNERS)
    data, lines = load_module._parse_yaml(path, path.read_text())
    assert data["optimizer"] == {"lr": 0.1, "momentum": 0.9, "name": "SGD"}
    assert data["data_args"]["nested"] == [[1, 2], {"a": [3, "4"]}]
    assert data["data_args"]["text"] == "two\nlines\n"
    assert str(data["data_args"]["when"]) == "2024-01-02"
    assert (lines[("optimizer", "name")], lines[("data_args", "nested", 1, "a", 1)]) == (6, 8)
    message = error_of(project, "model: [unclosed\n")  # NB: worded by each reader
    assert ":2:1: the YAML does not parse: " in message and "expected ',' or ']'" in message
    assert error_of(project, "model: " + "[" * 5000 + "]" * 5000 + "\n").endswith(
        ":1: nested more than 64 levels deep"
    )
