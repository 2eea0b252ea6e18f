"""Where an operator was issued: the user's line, and the library lines on the way to it.

`user_source()` (every op) walks the stack to the innermost frame of the user's code.

An op that fails inside a library is reported with the innermost line of each library
package between the op and the user's code, then the user's line, innermost first::

    torch/nn/functional.py:3504                       (torch)
    transformers/models/bert/modeling_bert.py:1010    (transformers)
    train.py:31                                       (yours)

torch's own machinery (module calls, dispatch, autograd, decorators) is skipped: the lines
worth reading are the ones that chose the math (`F.cross_entropy`, a modeling file).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import PurePath
from types import FrameType

from nandoctor.report.types import Frame
from nandoctor.runtime import wrappers
from nandoctor.setup import cuda_autocast
from nandoctor.user_files import is_nandoctor_file, is_user_file

# NB: path fragments (as displayed, '/'-separated) of plumbing between a user and the math
_MACHINERY = (
    "torch/nn/modules/module.py",
    "torch/nn/parallel/",
    "torch/utils/",
    "torch/_ops.py",
    "torch/overrides.py",
    "torch/_tensor.py",
    "torch/autograd/",
    "torch/amp/autocast_mode.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "torch/_jit_internal.py",
    "torch/_library/",
    "torch/_subclasses/",
    "torch/_functorch/",
    "torch/_higher_order_ops/",
    "torch/_prims",
    "torch/_refs/",
    "torch/_decomp/",
    "torch/distributed/",
    "torch/fx/",
    "transformers/utils/",
    "accelerate/",
)
_SITE_DIRS = ("site-packages", "dist-packages")
_PROBES_DIR = os.path.dirname(os.path.abspath(__file__))
_EMULATION_FILE = os.path.abspath(cuda_autocast.__file__)


def user_source() -> str | None:
    """`path:line` of the innermost frame in the user's code that issued the op.

    The walk skips the probes' own frames (the modes) and torch's; it stops at any other
    frame of nandoctor's (the loop that called into torch): an op the optimizer or the
    scaler issued has no user line, whatever called nandoctor.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            return f"{display_path(filename)}:{frame.f_lineno}"
        if is_nandoctor_file(filename) and not _passed_over(frame):
            return None
        frame = frame.f_back
    return None


def call_site(frame: FrameType | None = None) -> tuple[str | None, list[Frame]]:
    """(`path:line` of the user's frame, the frames shown): the innermost library frame
    of each package, then the user's. The walk stops at the user's frame, or at
    nandoctor's own loop (an op of the optimizer or the scaler has no user line)."""
    frame = frame if frame is not None else sys._getframe(1)
    frames: list[Frame] = []
    packages: set[str] = set()
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            frames.append(Frame(display_path(filename), frame.f_lineno, True))
            return f"{frames[-1].file}:{frames[-1].line}", frames
        if is_nandoctor_file(filename) and not _passed_over(frame):
            break
        shown = _library_file(filename)
        if shown is not None and shown[0] not in packages:
            packages.add(shown[0])
            frames.append(Frame(shown[1], frame.f_lineno, False))
        frame = frame.f_back
    return None, frames


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> tuple[str, str] | None:
    """(package, path as shown) of a library frame worth showing; None for machinery,
    the standard library and nandoctor's own probes."""
    if filename.startswith("<") or is_nandoctor_file(filename):
        return None
    parts = PurePath(os.path.abspath(filename)).parts
    sites = [i for i, part in enumerate(parts) if part in _SITE_DIRS]
    if sites:
        inside = parts[sites[-1] + 1 :]
    elif "torch" in parts:  # a source checkout of torch
        inside = parts[len(parts) - 1 - parts[::-1].index("torch") :]
    else:
        return None
    shown = "/".join(inside)
    if not inside or any(fragment in shown for fragment in _MACHINERY):
        return None
    return inside[0], shown


def _passed_over(frame: FrameType) -> bool:
    """A frame of nandoctor's that is never the caller: a probe's, or the wrapper of a
    custom Function's `apply` that brings its call to the tracer's `NodeRecorder`."""
    return is_probe_file(frame.f_code.co_filename) or wrappers.passes_through(frame)


def is_probe_file(filename: str) -> bool:
    """A file of the tracer's own (this folder), or the kernels that emulate CUDA's
    autocast on the CPU (they sit between the user's call and the op): their frames are
    never the caller."""
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _PROBES_DIR or path == _EMULATION_FILE


def display_path(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith("..") else rel
