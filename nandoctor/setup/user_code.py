"""The user-code boundary: every call nandoctor makes into the user's code (the model and
its factories, the data, the loss, backward, the optimizer and scheduler steps) goes
through `user_code(where)`, which says what the user's code did in terms of nandoctor's
errors and keeps the user's torch settings apart from nandoctor's own:

    with user_code(f"loss (step {step})"):
        loss = loss_fn(model, batch)       # raises ValueError: "shapes do not match"
                                           # -> UserCodeError: "loss (step 3) raised
                                           #    ValueError: shapes do not match" (exit 3)
"""

from __future__ import annotations

from nandoctor.errors import (
    NandoctorError,
    UserCodeError,
    UserCodeOutOfMemory,
    UserExit,
    out_of_memory,
)
from nandoctor.setup.peers import peer_failed, peer_failure
from nandoctor.setup.torch_globals import TorchGlobals


def user_code(where: str) -> UserCall:
    """Run a call into the user's code; whatever it raises becomes a `UserCodeError`.

    `sys.exit()` (and `os._exit`, see `ProcessExit`) there is the user's code ending the
    run: a `UserExit` (exit 3). A `KeyboardInterrupt` stays one: the run is interrupted.
    The global torch settings the user's code changes stay the user's: they are put back
    for nandoctor's own work after the call, and again for the user's next call
    (`TorchGlobals`)."""
    return UserCall(where)


class UserCall(TorchGlobals):
    """`user_code`'s context: the torch settings kept apart, and the error translated."""

    __slots__ = ("where",)

    def __init__(self, where: str) -> None:
        self.where = where

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        error = exc[1] if len(exc) > 1 else None
        if error is None or isinstance(error, NandoctorError):
            return
        if isinstance(error, SystemExit):
            raise UserExit(self.where, error) from error
        if isinstance(error, Exception):
            _raise_user_error(self.where, error)


def _raise_user_error(where: str, e: Exception) -> None:
    if peer_failed(e):
        raise peer_failure(e, where) from e
    if out_of_memory(e):
        raise UserCodeOutOfMemory(where, e) from e
    raise UserCodeError(where, e) from e
