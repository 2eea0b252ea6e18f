"""The terminal renderer reads a report and shows it: verdict, where, curves, notes."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from nandoctor.render.markdown import render_markdown
from nandoctor.render.terminal import StepProgress, describe_run, quiet_lines, render_report
from nandoctor.report.evidence import Evidence, ModuleStat, Producer, Recompute, TensorStats
from nandoctor.report.types import (
    Environment,
    Event,
    FirstNonfinite,
    Frame,
    Report,
    Telemetry,
    Transient,
)
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

SOURCE = """def loss(model, batch):
    x, y = batch
    p = torch.softmax(model(x), -1)
    return -(y * torch.log(p)).sum()
"""


def failing_report(tmp_path) -> Report:
    (tmp_path / "train.py").write_text(SOURCE)
    telemetry = Telemetry()
    for step, loss in enumerate([2.3, 1.9, 1.2, float("nan")]):
        telemetry.append(step, loss, 0.5, 65536.0)
    stats = TensorStats("self", "float16", [4, 10], 40, 1.0, 0.0, 1.0, 3, 0, 0, 0, 0, 65504.0)
    return Report(
        command="diagnose",
        config="run.yaml",
        environment=Environment("cpu", "2.13.0", "float16", True, 2),
        status="nonfinite",
        steps_completed=3,
        summary="step 3, phase loss: aten.log.default produced -inf",
        first_nonfinite=FirstNonfinite(
            3,
            "loss",
            None,
            "aten.log.default",
            "output",
            "-inf",
            "float16",
            [4, 10],
            3,
            f"{tmp_path / 'train.py'}:4",
            "exact",
        ),
        events=[
            Event(1, "scaler-skip", 65536.0, reason="overflow"),
            Event(2, "scaler-skip", 32768.0),
        ],
        telemetry=telemetry,
        evidence=Evidence(
            inputs=[stats],
            producers=[Producer("aten._softmax.default", None, "train.py:3", "loss", 1, "self")],
            recompute=Recompute("float32", False, None),
            modules=[ModuleStat("head", "Linear", "float16", 12.0)],
        ),
        notes=["a note"],
    )


def render(report: Report, quiet: bool = False) -> str:
    out = io.StringIO()
    render_report(
        Console(file=out, width=100, force_terminal=False, color_system=None), report, quiet
    )
    return out.getvalue()


def test_failure_panel_shows_where_and_why(tmp_path):
    text = render(failing_report(tmp_path))
    assert "NON-FINITE at step 3 · phase loss" in text
    assert "op      aten.log.default" in text
    assert "tensor  output: 3 × -inf in float16 [4, 10]" in text
    assert "❱ 4     return -(y * torch.log(p)).sum()" in text  # the line, highlighted
    assert "← self came from aten._softmax.default at train.py:3 (loss)" in text
    # a float16 softmax's zero, recomputed as it is: still -inf, but no "not the precision"
    assert "in float32 the same op on these inputs is still non-finite" in text
    assert "the math itself" not in text
    report = failing_report(tmp_path)
    inputs = [dataclasses.replace(i, dtype="float32") for i in report.evidence.inputs]
    report.evidence = dataclasses.replace(report.evidence, inputs=inputs)  # a float32 zero
    assert "the math itself, not the precision" in render(report)
    assert "GradScaler skips: 1 overflow, 1 unchecked" in text and "note: a note" in text
    assert "×" in text  # the NaN loss on the curve


def test_the_gradient_norm_runs_from_its_first_finite_value_past_the_scalers_skips(tmp_path):
    report = failing_report(tmp_path)
    telemetry = Telemetry()  # steps 0 and 1 skipped: their scaled gradients overflowed
    for step, norm in enumerate([float("nan"), float("nan"), 0.74, float("nan")]):
        telemetry.append(step, [2.3, 2.3, 1.9, float("nan")][step], norm, 65536.0 / 2**step)
    report.telemetry = telemetry
    text = render(report)
    assert "0.74 → nan" in text and "nan → nan" not in text
    assert "2.3 → nan" in text  # the loss's own first value, as it was


def test_zeros_that_had_no_part_in_an_overflow_are_not_offered_as_its_origin(tmp_path):
    """A matmul whose inputs hold ReLU's zeros overflowed (inf, and inf in float32 too):
    "their exact zeros may come from an earlier op's lower precision" pointed at them."""
    report = failing_report(tmp_path)
    first = dataclasses.replace(report.first_nonfinite, op="aten.mm.default", value="inf")
    report = dataclasses.replace(report, first_nonfinite=first)
    text = render(report)
    assert "exact zeros may come" not in text
    assert "in float32 the same op is still non-finite" in text


def test_a_module_outside_the_model_is_named_by_the_phase_it_ran_in(tmp_path):
    """No module path: in the loss phase, the loss or the loop; in the forward phase,
    another module the step called (a GAN's second model under `watch`), never the loss;
    in the input phase, none: the batch."""
    report = failing_report(tmp_path)
    assert "(outside the model: in the loss or the training loop)" in render(report)
    report.first_nonfinite = dataclasses.replace(report.first_nonfinite, phase="forward")
    text = render(report)
    assert "(outside the model: in another module the step called)" in text
    assert "in the loss or the training loop" not in text
    report.first_nonfinite = dataclasses.replace(report.first_nonfinite, phase="input")
    text = render(report)  # the batch itself: no module made it (it read "in the loss")
    assert "(none: the batch the model was called with)" in text
    assert "outside the model" not in text


def test_healthy_panel(tmp_path):
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite, report.summary = (
        "healthy",
        None,
        "all 4 steps stayed finite",
    )
    text = render(report)
    assert "HEALTHY" in text and "all 4 steps stayed finite" in text
    assert "op " not in text


def test_quiet_output_is_a_few_plain_lines(tmp_path):
    assert quiet_lines(failing_report(tmp_path)) == [
        "nandoctor diagnose run.yaml: NONFINITE",
        "  step 3, phase loss: aten.log.default produced -inf",
        "  cpu float16 grad_scaler=True (GradScaler skips: 1 overflow, 1 unchecked) threads=2",
    ]
    assert "\x1b[" not in render(failing_report(tmp_path), quiet=True)  # no colour codes


def test_a_failed_health_check_is_shown_with_every_check(tmp_path):
    from nandoctor.report.gate import Gate, GateCheck

    report = failing_report(tmp_path)
    report.status, report.first_nonfinite, report.summary = (
        "healthy",
        None,
        "all 4 steps stayed finite",
    )
    report.gate = Gate(
        "b.json",
        [
            GateCheck("headroom", True, "peak at 10%"),
            GateCheck("activation growth", False, "fc2 grew 2.0x"),
        ],
    )
    text = render(report)
    assert "HEALTH CHECK FAILED" in text and "numeric health against b.json" in text
    assert "✘ activation growth" in text and "fc2 grew 2.0x" in text and "✔ headroom" in text
    lines = quiet_lines(report)
    assert lines[0] == "nandoctor diagnose run.yaml: HEALTHY, HEALTH CHECK FAILED"
    assert (
        "  FAIL activation growth: fc2 grew 2.0x" in lines
        and "  ok   headroom: peak at 10%" in lines
    )


def with_library_frames_and_transients(report: Report) -> Report:
    first = report.first_nonfinite
    user = Frame(first.source.rpartition(":")[0], 4, True)
    library = [Frame("torch/nn/functional.py", 3555, False), Frame("transformers/x.py", 9, False)]
    report.first_nonfinite = dataclasses.replace(first, frames=[*library, user])
    report.transients = [
        Transient(3, "forward", "enc.0", "aten.log.default", "-inf", "train.py:3"),
        Transient(3, "forward", None, "aten.masked_fill.Scalar", "-inf", None),
    ]
    return report


def test_the_library_lines_and_the_healed_values_are_shown(tmp_path):
    text = render(with_library_frames_and_transients(failing_report(tmp_path)))
    assert "via     torch/nn/functional.py:3555" in text
    assert "        transformers/x.py:9" in text
    assert "healed on the way (seen, not the cause):" in text
    assert "aten.log.default in enc.0 at train.py:3 (forward, -inf)" in text
    assert "aten.masked_fill.Scalar outside the model (forward, -inf)" in text
    assert "None" not in text


def test_healed_values_are_shown_when_the_failure_was_not_reproduced(tmp_path):
    report = with_library_frames_and_transients(failing_report(tmp_path))
    report.first_nonfinite = FirstNonfinite(3, "loss", reproduced="not-reproduced")
    text = render(report)
    assert "aten.log.default in enc.0 at train.py:3 (forward, -inf)" in text
    assert "op      " not in text


def test_a_replay_that_met_the_failure_with_other_values_says_so_by_the_origin(tmp_path):
    report = failing_report(tmp_path)
    assert "replay  " not in render(report)  # exact: nothing to say
    report.first_nonfinite = dataclasses.replace(report.first_nonfinite, reproduced="values-differ")
    text = render(report)
    assert "op      aten.log.default" in text
    assert "replay  reproduced, with other values than the run's (nondeterministic)" in text


def test_the_progress_bar_shows_the_time_left():
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    progress = StepProgress(console, total=10)
    bar = progress._progress
    bar.update(progress._task, completed=5, loss="0.5")
    console.print(bar.make_tasks_table(bar.tasks))
    line = console.file.getvalue()
    assert "5/10" in line and "loss 0.5" in line and "eta" in line


def test_the_run_line_says_when_the_cpu_follows_cudas_autocast_lists(project):
    """The header names the autocast a CPU run computes with: CUDA's lists (the default
    policy) or the CPU's own."""

    def run_line(policy: str) -> str:
        precision = {"dtype": "float16", "autocast_policy": policy}
        config = project(base_config(precision=precision, device="cpu"))
        return describe_run(build_session(load_config(config)))

    assert "float16 autocast (CUDA's lists)" in run_line("cuda")
    assert "float16 autocast ·" in run_line("native")


def test_several_kinds_of_value_are_named_as_the_output_held_them(tmp_path):
    """An fp16 overflow both ways holds inf and -inf, no NaN: "NaN and inf" sent users
    looking for a 0/0 that was never there."""
    report = failing_report(tmp_path)
    report.first_nonfinite = dataclasses.replace(report.first_nonfinite, value="mixed")
    assert "3 × NaN or inf in float16" in render(report)  # NB: not counted: not guessed
    for (nan, posinf, neginf), said in [((1, 2, 0), "NaN and inf"), ((0, 1, 2), "inf and -inf")]:
        output = TensorStats(
            "out", "float16", [4, 10], 40, 1.0, 0.0, 1.0, 0, 0, nan, posinf, neginf, 65504.0
        )
        report.evidence = dataclasses.replace(report.evidence, output=output)
        text = render(report)
        assert f"3 × {said} in float16" in text and "mixed" not in text
        assert f"3 × {said}" in render_markdown(report)


def test_every_curve_keeps_its_label_beside_a_divergence_in_an_80_column_panel(tmp_path):
    """The divergence's sentence sat in the curves' third column: the panel squeezed the
    labels out to fit it (two rows of bare sparklines, an LSTM run's). Now it has a line
    of its own, under the curves, and each curve its label."""
    report = failing_report(tmp_path)
    report.telemetry = Telemetry()
    for step in range(60):
        diverged = step >= 30
        report.telemetry.append(
            step, 1495.0 + step if diverged else 7.7, 3.1e6 if diverged else 0.5, 65536.0
        )
    report.events = [
        Event(30, "divergence", metric="loss", value=1525.0, baseline=7.7),
        Event(30, "divergence", metric="grad_norm", value=3.1e6, baseline=0.5),
    ]
    out = io.StringIO()
    render_report(Console(file=out, width=80, color_system=None), report)
    rows = [line.strip("│ ") for line in out.getvalue().splitlines()]
    curves = [row for row in rows if "▁" in row or "█" in row]
    assert [row.split()[0] for row in curves] == ["loss", "grad", "loss"]  # grad norm, scale
    assert "^ loss diverged at step 30: 1.52e+03, 198x its recent level 7.7" in rows
    assert "^ gradient norm diverged at step 30: 3.1e+06, 6.2e+06x its recent level 0.5" in rows
