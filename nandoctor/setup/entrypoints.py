"""Resolve `package.module:attribute` and `path/to/file.py:attribute` to Python objects.

A file path is relative to the config file; `python_path` folders go on `sys.path` first.
Anything wrong with the *name* (no such module, file or attribute, not callable) is a
config error (exit 2). An exception raised while the user's module runs its top level is
the user's (exit 3).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nandoctor.errors import ConfigError, UserCodeError, kind_of


def add_python_path(base_dir: Path, folders: Iterable[str]) -> None:
    """Put the config's `python_path` folders (relative to the config) first on sys.path;
    a folder that is not there is a config error (a later 'no module named' would blame
    the entrypoint)."""
    for folder in reversed(list(folders)):
        resolved = (base_dir / folder).resolve()
        if not resolved.is_dir():
            what = "is not a folder" if resolved.exists() else "folder not found"
            raise ConfigError(
                f"python_path: '{folder}': {what}: {resolved}",
                hint="python_path folders are relative to the config file",
            )
        path = str(resolved)
        if path not in sys.path:
            sys.path.insert(0, path)


def resolve(spec: str, key: str, base_dir: Path) -> Callable[..., Any]:
    """The callable that `spec` names; `key` is the config key, for messages."""
    target, _, attribute = spec.rpartition(":")
    if target.endswith(".py"):
        module = _load_file(base_dir / target, key, spec)
    else:
        module = _import_module(target, key, spec)
    obj: Any = module
    where = target
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{key}: '{spec}': {where} has no attribute '{part}'{_did_you_mean(obj, part)}"
            )
        obj = getattr(obj, part)
        where = f"{where}:{part}" if where == target else f"{where}.{part}"
    if not callable(obj):
        raise ConfigError(f"{key}: '{spec}' is {kind_of(obj)}, expected a callable")
    return obj


def _did_you_mean(obj: Any, name: str) -> str:
    """The closest public name of `obj` (a module as the user named it, never our alias
    of a loaded file)."""
    names = [n for n in dir(obj) if not n.startswith("_")]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _import_module(name: str, key: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise ConfigError(
                f"{key}: '{spec}': no module named '{e.name}'",
                hint="add its folder to `python_path`, relative to the config file",
            ) from None
        raise UserCodeError(f"importing {name} (for {key})", e) from e
    except Exception as e:
        raise UserCodeError(f"importing {name} (for {key})", e) from e


def _load_file(path: Path, key: str, spec: str) -> Any:
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"{key}: '{spec}': file not found: {path}")
    # NB: one module per file, under a name derived from its path, so that two configs naming
    # the same file share it and two files with the same stem do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_nandoctor_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{key}: '{spec}': cannot load {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    _put_on_path(path.parent)  # as `python file.py` would, so its sibling imports work
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UserCodeError(f"loading {path.name} (for {key})", e) from e
    return module


def _put_on_path(folder: Path) -> None:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
