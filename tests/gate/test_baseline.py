"""A baseline gates only a run of its own numerics: the same dtype, and half-precision ops
cast by the same autocast lists. Another is refused before the run, in one line that says
what differs, instead of a gate passed or failed for a difference no change made."""

from __future__ import annotations

import pytest

from nandoctor.errors import UsageError
from nandoctor.gate.baseline import Baseline, require_comparable, require_same_model
from nandoctor.report.health import GradNorms, Health, ModuleHealth
from nandoctor.report.types import Environment

HEALTH = Health(10, 0.5, GradNorms(0.5, 1.0, 2.0, 3.0), 0, 0, 0.1, "", [])


def recorded(
    dtype="float16", device="cpu", policy: str | None = "cuda", scaler: bool | None = True
) -> Baseline:
    return Baseline("c.yaml", None, dtype, device, "2.x", 0, 10, HEALTH, policy, scaler)


def run(dtype="float16", device="cpu", policy="cuda", scaler=True) -> Environment:
    return Environment(device, "2.x", dtype, scaler, 2, autocast_policy=policy)


def refusal(baseline: Baseline, environment: Environment) -> str:
    with pytest.raises(UsageError) as caught:
        require_comparable(baseline, "b.json", environment)
    return caught.value.message


def test_a_run_of_the_baselines_own_numerics_is_gated():
    require_comparable(recorded(), "b.json", run())
    require_comparable(recorded(policy="native"), "b.json", run(policy="native"))


def test_a_run_in_another_dtype_is_refused_naming_both():
    message = refusal(recorded("float16"), run("bfloat16"))
    assert message.startswith("--baseline b.json: recorded in float16, this run trains in bfloat16")
    assert "--dtype bfloat16" in message


def test_a_cpu_run_under_other_autocast_lists_is_refused():
    # CPU autocast keeps softmax, log and norms in float16; CUDA's lists run them in float32
    message = refusal(recorded(policy="native"), run(policy="cuda"))
    assert "the CPU's own autocast lists" in message and "CUDA's autocast lists" in message


def test_on_a_cuda_device_the_policy_is_cudas_lists_whatever_it_says():
    require_comparable(recorded(device="cuda:0", policy="native"), "b.json", run(policy="cuda"))
    assert "CUDA's" in refusal(recorded(device="cuda:0"), run(policy="native"))


def test_float32_autocasts_nothing_so_the_policy_does_not_matter():
    require_comparable(recorded("float32", policy="native"), "b.json", run("float32"))


def test_a_baseline_recorded_before_it_kept_its_policy_is_checked_on_its_dtype():
    require_comparable(recorded(policy=None), "b.json", run(policy="native"))
    assert "recorded in float32" in refusal(recorded("float32", policy=None), run())


def test_a_run_with_or_without_a_grad_scaler_unlike_its_baseline_is_refused():
    """With a scaler the recorded gradients carry its scale: a run without one, its
    gradients grown 55,000x, passed against them."""
    message = refusal(recorded(scaler=True), run(scaler=False))
    assert "recorded with a GradScaler, this run has none" in message
    assert "recorded with none, this run has a GradScaler" in refusal(recorded(scaler=False), run())
    require_comparable(recorded(scaler=None), "b.json", run(scaler=False))  # an older baseline


def test_a_model_that_grew_or_lost_layers_is_still_gated_on_the_rest():
    """Only a baseline that shares no module with the run is another model's; a grown
    model's new layers are judged by the gate ("not measured in the baseline")."""
    modules = [ModuleHealth("", "Net", 1.0), ModuleHealth("fc1", "Linear", 1.0)]
    baseline = recorded()
    baseline.health = Health(10, 0.5, GradNorms(0.5, 1.0, 2.0, 3.0), 0, 0, 0.1, "", modules)
    require_same_model(baseline, "b.json", {"": "Net", "fc1": "Linear", "fc9": "Linear"})
    with pytest.raises(UsageError, match="recorded from another model"):
        require_same_model(baseline, "b.json", {"": "Net", "fc1": "Conv2d"})
    require_same_model(recorded(), "b.json", {"": "Net"})  # recorded no module: unknown


def test_a_model_sharing_a_layer_by_chance_is_another_model():
    """A Conv1d network's `2 Linear` matches an MLP's by name and type: gating that one
    layer passed the whole other model. Under half of the baseline's modules: refused."""
    mlp = [ModuleHealth(str(i), "Linear", 1.0) for i in (0, 2, 4, 6)]
    baseline = recorded()
    baseline.health = Health(10, 0.5, GradNorms(0.5, 1.0, 2.0, 3.0), 0, 0, 0.1, "", mlp)
    conv = {"": "Sequential", "0": "Conv1d", "1": "Flatten", "2": "Linear"}
    with pytest.raises(UsageError) as caught:
        require_same_model(baseline, "b.json", conv)
    message = caught.value.message
    assert "only 1 of its 4 modules are in this run's" in message
    assert "(not in this run: 0 Linear, 4 Linear" in message
    assert "this run's: 0 Conv1d, 1 Flatten, 2 Linear)" in message
    require_same_model(baseline, "b.json", {"0": "Linear", "2": "Linear", "8": "Linear"})
