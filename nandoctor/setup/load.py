"""Read a config file into a `Config`, or fail with one line per problem.

    configs/run.yaml:7: precision.dtype: unknown dtype 'float8': expected one of float16, ...
    configs/run.yaml:3: unknown key 'optimiser'; did you mean 'optimizer'?

The YAML is parsed once with the safe loader (libyaml's, where PyYAML has it) into nodes,
which give the line of every key and are checked (depth, aliases, duplicate keys) before
they are built into plain data for pydantic.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from nandoctor.errors import ConfigError
from nandoctor.setup.schema import Config

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and the file it came from (relative paths start there)."""

    config: Config
    path: Path
    lines: dict[Loc, int] = field(default_factory=dict, compare=False)  # key -> line

    @property
    def base_dir(self) -> Path:
        return self.path.resolve().parent

    def placed(self, error: ConfigError) -> ConfigError:
        """`error` naming this file, and the line of the key it starts with (`optimizer:
        ...` raised while building the run names no file: SPEC wants file, key and what
        was expected)."""
        if error.message.startswith(str(self.path)):
            return error
        key = error.message.split(":", 1)[0]
        line = _line_of(tuple(key.split(".")), self.lines) if " " not in key else None
        where = f"{self.path}:{line}" if line else str(self.path)
        return ConfigError(f"{where}: {error.message}", hint=error.hint)

    def with_overrides(self, **changes: object) -> LoadedConfig:
        """A copy with command-line options applied (`dtype=` and `autocast_policy=` reach
        into `precision`)."""
        updates = {k: v for k, v in changes.items() if v is not None}
        inner: dict[str, object] = {
            k: updates.pop(k) for k in ("dtype", "autocast_policy") if k in updates
        }
        if inner:
            updates["precision"] = self.config.precision.model_copy(update=inner)
        return LoadedConfig(self.config.model_copy(update=updates), self.path, self.lines)


def load_config(path: str | Path) -> LoadedConfig:
    path = Path(path)
    try:
        text = read_at_most(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except FileTooLarge as e:
        raise ConfigError(f"{path}: the config is {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file: {e}") from None
    data, lines = _parse_yaml(path, text)
    if data is None:
        raise ConfigError(
            f"{path}: the config is empty: expected a mapping with model, data, optimizer"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected a mapping of keys (model:, data:, ...); got a {type(data).__name__}"
        )
    try:
        config = Config.model_validate(data)
    except pydantic.ValidationError as e:
        raise ConfigError(format_validation_error(path, e, lines)) from None
    return LoadedConfig(config, path, lines)


# NB: a config may carry data (260,000 per-sample weights exported into `data_args`):
# legal, so the limit is what no config needs, and stops a device that never ends
MAX_CONFIG_BYTES = 64 << 20


class FileTooLarge(ValueError):
    """`70000000 bytes, more than the limit of 67108864 (64 MiB)`; `more than the limit of
    67108864 bytes (64 MiB)` where the file has no size (a device, a pipe)."""

    def __init__(self, size: int | None, limit: int) -> None:
        mib = f" ({limit >> 20} MiB)" if limit >= 1 << 20 and limit % (1 << 20) == 0 else ""
        super().__init__(
            f"{size} bytes, more than the limit of {limit}{mib}"
            if size is not None
            else f"more than the limit of {limit} bytes{mib}"
        )


def read_at_most(path: Path, limit: int) -> str:
    """The file's UTF-8 text; `FileTooLarge` beyond `limit` bytes. NB: what is read is
    counted, not what the file says its size is: a device (/dev/zero) or a pipe has no
    size, and may never end."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
        if len(data) > limit:
            size = os.fstat(f.fileno()).st_size
            raise FileTooLarge(size if size > limit else None, limit)
    return data.decode("utf-8")


MAX_DEPTH = 64  # nesting of mappings and lists, aliases expanded
# Values aliases may add to those written out: an alias bomb ("billion laughs") expands
# a few lines into 10^9 values; written-out values are bounded by the file's size
MAX_ALIASED = 100_000

# NB: libyaml's reader where PyYAML was built with it (it nearly always is): the pure
# Python one reads ~0.3 MiB a second, 10x slower; both are safe loaders
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse_yaml(path: Path, text: str) -> tuple[Any, dict[Loc, int]]:
    """The file's data and the line of each key. NB: parsed once into nodes, checked
    (depth, aliases, duplicate keys) and only then built into data, from those nodes."""
    try:
        _check_depth(path, text)
        root = yaml.compose(text, Loader=_LOADER)
        if root is None:
            return None, {}
        _check_expanded(path, root)
        lines: dict[Loc, int] = {}
        _index_lines(path, root, (), lines)
        data = yaml.constructor.SafeConstructor().construct_document(root)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if "exceeded maximum nesting depth" in problem:  # NB: libyaml's own limit, 1000
            line = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError(f"{line}: nested more than {MAX_DEPTH} levels deep") from None
        raise ConfigError(f"{where}: the YAML does not parse: {problem}") from None
    return data, lines


_OPENS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSES = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _check_depth(path: Path, text: str) -> None:
    """Refuse, before building anything, a file nested too deeply (the parser itself
    recurses once per level; a file too large was refused as it was read)."""
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                line = event.start_mark.line + 1
                raise ConfigError(f"{path}:{line}: nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, _CLOSES):
            depth -= 1


def _check_expanded(path: Path, root: yaml.Node) -> None:
    """Refuse aliases that expand into a huge or endless config (a "billion laughs" file,
    an alias inside its own anchor): counted on the node graph, nothing expanded. What is
    written out is bounded by the file's size; what aliases add to it, by `MAX_ALIASED`.
    NB: a list of 260,000 numbers is 260,000 scalars: they are counted, not walked."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, levels) below it
    open_: set[int] = set()
    written = 1  # the values in the file, an alias counted as one

    def walk(node: yaml.Node, depth: int) -> tuple[int, int]:
        nonlocal written
        key = id(node)
        if key in open_:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: an alias refers to itself")
        if key not in sizes:
            open_.add(key)
            children = _children(node)
            nested = [c for c in children if not isinstance(c, yaml.ScalarNode)]
            below = [walk(c, depth + 1) for c in nested]
            open_.discard(key)
            written += len(children)
            count = 1 + len(children) - len(nested) + sum(n for n, _ in below)
            sizes[key] = (count, 1 + max((h for _, h in below), default=int(bool(children))))
        count, height = sizes[key]
        if depth + height > MAX_DEPTH:
            raise _aliases_expand(path)
        return count, height

    expanded, _ = walk(root, 0)
    if expanded - written > MAX_ALIASED:
        raise _aliases_expand(path)


def _aliases_expand(path: Path) -> ConfigError:
    return ConfigError(
        f"{path}: its aliases expand to more than {MAX_ALIASED} values beyond those "
        f"written out, or {MAX_DEPTH} levels; write the values out instead"
    )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _index_lines(path: Path, node: yaml.Node, loc: Loc, lines: dict[Loc, int]) -> None:
    """Map each key path to its 1-based line; refuse duplicate keys, which YAML hides."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            if key in seen:
                first = seen[key]
                raise ConfigError(
                    f"{path}:{line}: {_dotted((*loc, key))}: duplicate key (first on line {first})"
                )
            seen[key] = line
            where = (*loc, key)
            lines[where] = line
            _index_lines(path, value_node, where, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            where = (*loc, i)
            lines[where] = item.start_mark.line + 1
            if not isinstance(item, yaml.ScalarNode):  # NB: 260,000 numbers are no mappings
                _index_lines(path, item, where, lines)


def format_validation_error(
    path: Path, error: pydantic.ValidationError, lines: dict[Loc, int]
) -> str:
    errors = sorted(error.errors(), key=lambda e: _line_of(_clean_loc(e), lines) or 0)
    # NB: a misspelt key (`optimiser`) also leaves its key missing: the "did you mean" says
    # both, and the "missing required key 'optimizer'" line, printed first, said less
    meant = {
        (*loc[:-1], close)
        for e in errors
        if e["type"] == "extra_forbidden"
        and (loc := _clean_loc(e))
        and (close := _closest(loc)) is not None
    }
    errors = [e for e in errors if not (e["type"] == "missing" and _clean_loc(e) in meant)]
    return "\n".join(_format_one(path, e, lines) for e in errors)


def _clean_loc(err: Any) -> Loc:
    # NB: pydantic puts validator names such as 'function-after[...]' into the location;
    # a user's key may look alike ('function-'), so only the bracketed form is dropped.
    return tuple(p for p in err["loc"] if not (isinstance(p, str) and _VALIDATOR.match(p)))


_VALIDATOR = re.compile(r"^function-(after|before|wrap|plain)\[")


def _format_one(path: Path, err: Any, lines: dict[Loc, int]) -> str:
    loc = _clean_loc(err)
    line = _line_of(loc, lines)
    where = f"{path}:{line}" if line else str(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"{where}: unknown key '{_dotted(loc)}'{_did_you_mean(loc)}"
    if kind == "missing":
        return f"{where}: missing required key '{_dotted(loc)}'"
    if kind == "model_type":  # NB: not our class's name: the user wrote a section
        got = err.get("input")
        factory = err.get("ctx", {}).get("class_name") == "FactorySpec"
        named = f": write {{name: {got}}}" if factory and isinstance(got, str) else ""
        return f"{where}: {_dotted(loc)}: expected a mapping of keys; got {got!r}{named}"
    message = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    message = message.replace("Input should be", "expected", 1)
    message = message.replace("expected greater than", "expected a value greater than")
    message = message.replace("expected less than", "expected a value less than")
    got = err.get("input")
    already_quoted = isinstance(got, str) and repr(got) in message
    suffix = "" if isinstance(got, dict) or already_quoted else f"; got {got!r}"
    key = _dotted(loc) or "config"
    return f"{where}: {key}: {message}{suffix}"


def _line_of(loc: Loc, lines: dict[Loc, int]) -> int | None:
    for n in range(len(loc), 0, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(loc: Loc) -> str:
    if not loc:
        return ""
    close = _closest(loc)
    if close is not None:
        return f"; did you mean '{close}'?"
    known = _known_keys(loc[:-1])
    return f"; expected one of: {', '.join(known)}" if known else ""


def _closest(loc: Loc) -> str | None:
    """The accepted key an unknown one is closest to, if one is close."""
    if not loc:
        return None
    close = difflib.get_close_matches(str(loc[-1]), _known_keys(loc[:-1]), n=1, cutoff=0.6)
    return close[0] if close else None


def _known_keys(loc: Loc) -> list[str]:
    """The keys a section of the config accepts, found by walking the model classes."""
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = _model_in(field.annotation) if field else None
        if model is None:
            return []
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    for c in candidates:
        if isinstance(c, type) and issubclass(c, pydantic.BaseModel):
            return c
    return None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
