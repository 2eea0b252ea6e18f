"""Reliability properties: any config mapping validates or is a config error; the user's
files are never written; the same config and seed give the same report."""

from __future__ import annotations

import hashlib

import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nandoctor.diagnose.engine import diagnose
from nandoctor.errors import ConfigError
from nandoctor.setup.load import load_config
from nandoctor.setup.schema import Config
from tests.helpers.project import TRAIN_PY, base_config

KEYS = [*Config.model_fields, "precision.dtype", "optimiser", "stepz", ""]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
MAPPINGS = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=10), VALUES, max_size=8)
QUICK = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@QUICK
@given(MAPPINGS)
def test_any_mapping_validates_or_is_a_config_error(tmp_path_factory, mapping):
    path = tmp_path_factory.mktemp("c") / "config.yaml"
    path.write_text(yaml.safe_dump(mapping, allow_unicode=True))
    try:
        load_config(path)
    except ConfigError as e:
        assert e.message and str(path) in e.message.splitlines()[0]


@QUICK
@given(st.text(max_size=200))
def test_any_text_validates_or_is_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("t") / "config.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        assert e.message


def digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_the_users_files_and_checkpoint_are_byte_identical_after_a_run(project, tmp_path):
    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    torch.save({"model": namespace["build_model"]().state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    path = project(base_config(checkpoint="ckpt.pt", data_args={"nan_at": 1}, steps=4))
    before = digest(tmp_path)
    report = diagnose(load_config(path))
    assert report.status == "nonfinite"  # a run that rewinds, replays and verifies fixes
    assert digest(tmp_path) == before


def test_the_same_config_and_seed_give_the_same_report_three_times(project):
    path = project(base_config(data_args={"nan_at": 2}, optimizer={"name": "Adam", "lr": 0.01}))
    reports = [diagnose(load_config(path)).to_dict() for _ in range(3)]
    for r in reports:
        r.pop("timing")
    assert reports[0] == reports[1] == reports[2]
    assert reports[0]["causes"][0]["verified"] is True  # verification included
