"""Optional integrations: the guard inside other people's training loops.

    from nandoctor.integrations.lightning import NandoctorCallback      # pip install lightning
    from nandoctor.integrations.transformers import NandoctorCallback   # pip install transformers

Each module imports its framework when it is imported itself (never from nandoctor's
core) and says which extra to install when the framework is missing.
"""

from __future__ import annotations

from nandoctor.errors import NandoctorError


class MissingExtraError(NandoctorError, ImportError):
    """An integration's framework is not installed (an ImportError, for `try: import`)."""

    def __init__(self, integration: str, package: str, extra: str) -> None:
        super().__init__(
            f"nandoctor.integrations.{integration} needs {package}, which is not installed",
            hint=f"pip install 'nandoctor[{extra}]' (or pip install {package})",
        )
