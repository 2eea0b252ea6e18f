"""errors: what a user's failing call shows of its traceback: their own frames, else the
library's last one, never nandoctor's."""

from __future__ import annotations

import functools

import torch

import nandoctor.setup.session as session_module
from nandoctor.errors import UserCodeError

CALLER = """
def call(fn):
    try:
        fn()
    except Exception as e:
        return e
"""


def caught_in_nandoctor(fn) -> UserCodeError:
    """`fn`'s error as nandoctor catches it, its traceback starting in nandoctor's frame."""
    scope: dict = {}
    exec(compile(CALLER, session_module.__file__, "exec"), scope)
    return UserCodeError("model train.py:build_model", scope["call"](fn))


def test_an_error_from_inside_torch_shows_the_library_frame_it_came_from():
    wrong_width = functools.partial(torch.nn.Linear(3, 2), torch.ones(2, 4))
    error = caught_in_nandoctor(wrong_width)
    (frame,) = error.user_frames()
    assert "torch" in frame.filename


def test_an_error_of_nandoctors_own_call_shows_no_frame_of_it():
    error = caught_in_nandoctor(len)  # the call itself raised: len() takes one argument
    assert error.user_frames() == []
