"""NumPy and JAX code: the checks speak torch only, so nothing here is reported."""

import jax.numpy as jnp
import numpy as np
from jax.nn import softmax


def entropy(logits):
    p = softmax(logits)
    return -(p * jnp.log(p)).sum() + np.log(p.sum())


def normalize(x):
    return x / x.sum()
