"""The rules: one small function per cause id, reading a `Case`, returning a `Hit` (a
confidence and evidence sentences that quote what was observed) or None.

Rules never look at names of examples or configs; they read the origin op and its inputs,
the ops that made them, the float32 recomputation, module magnitudes, telemetry trends and
the run's settings. Several can hold at once; `rank` orders them, best first. Each module
holds one family: `phases`, `arithmetic`, `precision`, `dynamics`.
"""

from nandoctor.causes.rules import arithmetic, dynamics, phases, precision  # noqa: F401
from nandoctor.causes.rules.registry import RULES, Hit, rank, rule

__all__ = ["RULES", "Hit", "rank", "rule"]
