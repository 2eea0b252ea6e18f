"""Entrypoints: `package.module:attr` and `path/file.py:attr`, relative to the config."""

from __future__ import annotations

import pytest

from nandoctor.errors import ConfigError, UserCodeError
from nandoctor.setup.entrypoints import add_python_path, resolve
from tests.helpers.project import TRAIN_PY


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(
        "def build():\n    return 'built'\n\nclass Zoo:\n    def make():\n        return 1\n"
    )
    (pkg / "broken.py").write_text("import does_not_exist_anywhere\n")
    (pkg / "explodes.py").write_text("raise ValueError('top-level failure')\n")
    return tmp_path


def test_file_form_is_relative_to_the_config(user_dir):
    fn = resolve("train.py:build_model", "model", user_dir)
    assert fn.__name__ == "build_model"


def test_module_form_through_python_path(user_dir):
    add_python_path(user_dir, ["src"])
    assert resolve("mypkg.models:build", "model", user_dir)() == "built"


def test_dotted_attribute(user_dir):
    add_python_path(user_dir, ["src"])
    assert resolve("mypkg.models:Zoo.make", "model", user_dir)() == 1


def test_same_file_is_loaded_once(user_dir):
    a = resolve("train.py:build_model", "model", user_dir)
    b = resolve("train.py:build_data", "data", user_dir)
    assert a.__module__ == b.__module__


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("nowhere.py:build", "model: 'nowhere.py:build': file not found"),
        ("train.py:nothing", "model: 'train.py:nothing': "),
        (
            "no_such_package_xyz.mod:build",
            "model: 'no_such_package_xyz.mod:build': no module named",
        ),
        ("train.py:NOT_CALLABLE", "model: 'train.py:NOT_CALLABLE' is an int, expected a callable"),
    ],
)
def test_bad_names_are_config_errors(user_dir, spec, expected):
    with pytest.raises(ConfigError) as info:
        resolve(spec, "model", user_dir)
    assert info.value.message.startswith(expected)
    assert info.value.exit_code == 2


def test_missing_attribute_names_it(user_dir):
    with pytest.raises(ConfigError, match="has no attribute 'nothing'"):
        resolve("train.py:nothing", "model", user_dir)


def test_a_typo_gets_a_did_you_mean_in_the_users_own_terms(user_dir):
    with pytest.raises(ConfigError) as info:
        resolve("train.py:build_modle", "model", user_dir)
    assert info.value.message == (
        "model: 'train.py:build_modle': train.py has no attribute 'build_modle'; "
        "did you mean 'build_model'?"
    )
    assert "_nandoctor_user" not in str(info.value)


def test_an_import_inside_the_user_module_failing_is_the_users_error(user_dir):
    add_python_path(user_dir, ["src"])
    with pytest.raises(UserCodeError) as info:
        resolve("mypkg.broken:x", "model", user_dir)
    assert info.value.exit_code == 3
    assert "does_not_exist_anywhere" in info.value.message


def test_user_module_raising_at_import_is_exit_3_with_its_frame(user_dir):
    add_python_path(user_dir, ["src"])
    with pytest.raises(UserCodeError) as info:
        resolve("mypkg.explodes:x", "model", user_dir)
    frames = info.value.user_frames()
    assert frames[-1].filename.endswith("explodes.py")
    assert frames[-1].lineno == 1
