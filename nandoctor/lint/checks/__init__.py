"""The checks, one module per cause id; importing this package registers them all.

`ORDER` is the order of docs/lint.md and of SARIF's rule list: errors first, heuristics
last (the imports below are sorted by name, which says nothing).
"""

from nandoctor.lint.checks import (  # noqa: F401  (each module registers its check)
    clip_before_unscale,
    division_by_zero,
    eps_underflow,
    exploding_gradients,
    fp16_without_grad_scaler,
    fully_masked_softmax,
    log_of_softmax,
    log_of_zero,
    nondifferentiable_point,
)

ORDER = (
    "log-of-softmax",
    "log-of-zero",
    "clip-before-unscale",
    "exploding-gradients",
    "fp16-without-grad-scaler",
    "fully-masked-softmax",
    "eps-underflow",
    "nondifferentiable-point",
    "division-by-zero",
)
