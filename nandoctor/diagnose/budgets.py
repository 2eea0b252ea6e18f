"""Default time budgets of `diagnose`'s stages, in seconds.

NB: a module of its own, free of torch, so that `nandoctor diagnose --help` can show them
without importing the engine.
"""

DEFAULT_VERIFY_BUDGET = 300.0  # seconds for all what-if replays together
