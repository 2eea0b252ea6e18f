"""A cause's before/after code in the run's terms: no GradScaler lines without a scaler."""

from __future__ import annotations

from nandoctor.causes import catalog
from nandoctor.causes.snippets import for_run


def test_a_run_without_a_scaler_gets_the_plain_loop():
    info = catalog.get("exploding-gradients")
    before, after = for_run(info.before, info.after, grad_scaler=False)
    assert before == "loss.backward()\nopt.step()"
    assert after == (
        "loss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "opt.step()"
    )


def test_a_run_with_a_scaler_gets_the_snippet_as_written():
    info = catalog.get("exploding-gradients")
    assert for_run(info.before, info.after, grad_scaler=True) == (info.before, info.after)


def test_snippets_about_the_scaler_itself_stay_as_written():
    for cause in ("grad-scaler-collapse", "fp16-overflow", "clip-before-unscale"):
        info = catalog.get(cause)
        assert for_run(info.before, info.after, grad_scaler=False) == (info.before, info.after)
