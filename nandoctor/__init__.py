"""nandoctor: find the step, the tensor and the cause when a PyTorch run turns NaN."""

from typing import TYPE_CHECKING, Any

from nandoctor.version import __version__

__all__ = ["Guard", "NonFiniteError", "__version__"]

if TYPE_CHECKING:
    from nandoctor.guard import Guard, NonFiniteError


def __getattr__(name: str) -> Any:
    # NB: lazy, so that `import nandoctor` (run by every process `watch` starts) stays free
    # of torch until the Python API is used
    if name in ("Guard", "NonFiniteError"):
        from nandoctor import guard

        return getattr(guard, name)
    raise AttributeError(f"module 'nandoctor' has no attribute {name!r}")
