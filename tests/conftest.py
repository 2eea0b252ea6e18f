"""Shared fixtures: a throwaway project folder holding a user's train.py and config.yaml.
Plain helpers live in tests/helpers/, imported by name."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers.project import TRAIN_PY


@pytest.fixture(autouse=True)
def _no_global_patch_outlives_its_test():
    """A test that leaves nandoctor's global patches on (a guard never closed) changes every
    test after it: a fix replay then meets torch's softmax wrapped. Fail that test, then
    give torch its callables back."""
    from nandoctor.runtime import wrappers

    yield
    left = sorted(set(wrappers._patched.values()))
    for patches in [v for v in vars(wrappers).values() if isinstance(v, wrappers._Patches)]:
        for listener in list(patches.listeners):
            patches.unregister(listener)
    assert not left, f"nandoctor's global patches left on after the test: {left}"


@pytest.fixture
def project(tmp_path: Path):
    """Returns `write(config: dict | str, code: str = TRAIN_PY) -> Path` of the config."""

    def write(config: dict | str, code: str = TRAIN_PY, name: str = "config.yaml") -> Path:
        (tmp_path / "train.py").write_text(textwrap.dedent(code))
        path = tmp_path / name
        text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        path.write_text(textwrap.dedent(text))
        return path

    return write
