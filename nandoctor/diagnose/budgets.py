"""Default time budgets of `diagnose`'s stages, in seconds.

NB: a module of its own, free of torch, so that `nandoctor diagnose --help` can show them
without importing the engine.
"""

DEFAULT_VERIFY_BUDGET = 300.0  # seconds for all what-if replays together
# NB: a fix refuted from the snapshot is replayed from the run's start only while all the
# stages after the run stay within this share of the run's own time (a verified diagnosis
# at 1.5x the run's time to the failing step), or where that replay is short: these steps
# at most, or these seconds at the run's pace (diagnose/rewind.py)
REWIND_SHARE = 0.5
REWIND_FLOOR_STEPS = 256
REWIND_FLOOR = 10.0
