"""Whether an error in a rank of a data-parallel job says another rank failed.

A collective fails in every rank when one rank dies or hangs; the surviving ranks then
print one line that points at the rank whose own error explains it (`PeerFailure`, exit 3),
not a traceback of their own. Used by the user-code boundary (`setup.user_code`) and the
CLI (nandoctor's own collectives). NB: torch is not imported here: the errors are told by
name and text, and `--help` stays torch-free.
"""

from __future__ import annotations

import os

from nandoctor.errors import PeerFailure


def peer_failed(error: BaseException) -> bool:
    """In a rank of a data-parallel job: the error says another rank is gone or silent
    (torch.distributed's `DistError`s, or what gloo and NCCL say; by name, not by
    class: torch is not imported here)."""
    if "RANK" not in os.environ:  # not a worker of a data-parallel job
        return False
    if isinstance(error, OSError):  # this process's own file or pipe (`| head`): gloo and
        return False  # NCCL raise their "Broken pipe" as torch's errors, never as OSError
    name = type(error).__name__
    text = str(error)
    return name in ("DistError", "DistBackendError", "DistNetworkError") or any(
        s in text for s in _PEER_GONE
    )


def peer_failure(error: BaseException, where: str) -> PeerFailure:
    """The one line a rank prints when a collective failed because of another rank."""
    rank = os.environ.get("RANK", "?")
    if "Timed out" in str(error) or "timed out" in str(error):
        return PeerFailure(
            f"rank {rank}: another rank hung: no answer within distributed.timeout_s "
            f"during {where}",
            hint="a rank stuck in its data or its model; raise distributed.timeout_s if slow",
            hung=True,
        )
    return PeerFailure(
        f"rank {rank}: another rank failed or hung during {where}",
        hint="that rank's own error is printed above",
    )


# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_GONE = (
    "Connection closed by peer",
    "remote worker crashing",
    "Timed out",
    "Read error",
    "Connection reset by peer",
    "Broken pipe",
)
