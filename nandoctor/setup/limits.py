"""Bounds on what a config or a command line may ask for.

NB: free of pydantic and torch, so that the command line's options can state them in
`--help` without loading the config's models.
"""

import sys

MAX_STEPS = sys.maxsize  # the platform's index range: a step is an index (islice, tensors)
