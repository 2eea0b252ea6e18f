"""The benchmark runs end to end at tiny sizes, so it cannot rot. It asserts that it
runs and reports every figure, not its timings (those belong to docs/performance.md)."""

from __future__ import annotations

import json
import random
import statistics

from benchmarks.measure import DIAGNOSIS_REPEATS, Spread, median_interval
from benchmarks.render import _flags, _missed, _paired, _step_targets, _sync_targets
from benchmarks.run import main


def test_the_benchmark_runs_at_tiny_sizes(capsys, tmp_path):
    results = tmp_path / "results.json"
    args = ["--size", "tiny", "--rounds", "1", "--steps", "1", "--failing-step", "4"]
    args += ["--process-workloads", "mlp-wide-fp32", "--process-seconds", "0.1"]
    args += ["--process-pairs", "1", "--verified-milestone", "10", "--verified-pairs", "1"]
    args += ["--workloads", "mlp-fp16", "mlp-wide-fp32", "--start-up-repeats", "1"]
    args += ["--out", "-", "--json", str(results)]
    assert main(args) == 0
    out = capsys.readouterr()
    page = out.out
    for heading in (
        "## Targets",
        "## Whole process",
        "### Time to a verified diagnosis (mlp-wide-fp32, learning rate jumping at step 10)",
        "## Step time",
        "## Host reads per step",
        "## Time to diagnosis",
        "## Snapshot memory",
        "## Start-up",
    ):
        assert heading in page
    assert "nandoctor found: step 4, phase input" in page
    assert "`sentinel` step time / plain, mlp-fp16" in page
    assert "| `diagnose` whole process / plain script, mlp-wide-fp32 |" in page
    assert "| `diagnose` system time / plain script's, mlp-wide-fp32 |" in page
    assert "| loop | plain+norm | sentinel |" in page  # the floor beside what it bounds
    assert "| start-up of `nandoctor lint train.py` (one training script) |" in page
    # each figure said what it found as it came, with the minutes so far
    assert "min] whole process, mlp-wide-fp32 (" in out.err
    assert "min] verified time to diagnosis: " in out.err
    figures = json.loads(results.read_text())
    # the store measured at its largest: two snapshots of the whole state, Adam's included
    assert figures["snapshot_memory"]["ratio"] > 1.0
    ratios = figures["time_to_diagnosis"]["ratios"]  # side by side, pair by pair
    assert len(ratios) == DIAGNOSIS_REPEATS
    assert figures["time_to_diagnosis"]["ratio"] == statistics.median(ratios)
    (whole,) = figures["process"]  # each arm launched once, its own usage measured
    assert {arm: len(runs) for arm, runs in whole["usage"].items()} == {
        "plain": 1, "plain+malloc": 1, "diagnose": 1
    }  # fmt: skip
    assert whole["usage"]["diagnose"][0]["ended"]["status"] == "healthy"
    assert all(u["peak_mib"] > 0 and u["user_s"] > 0 for u in whole["usage"]["plain"])


def _step(sentinel: float, floor: float) -> dict:
    ratio = {"sentinel": {"median": sentinel}, "plain+norm": {"median": floor}}
    return {"workload": "mlp-fp32", "ms": {"plain": {"median": 8.0}}, "ratio": ratio}


def test_a_missed_target_says_when_the_gradient_pass_alone_misses_it_too():
    text = "\n".join(_missed([_step(sentinel=1.06, floor=1.035)]))
    assert "`sentinel` on mlp-fp32 (8.0 ms): +0.48 ms" in text
    assert "(`plain+norm`), is over the\nsentinel's 1.03x there: mlp-fp32 1.035x." in text


def test_a_floor_within_the_target_is_not_blamed_for_the_miss():
    text = "\n".join(_missed([_step(sentinel=1.06, floor=1.01)]))
    assert "+0.48 ms" in text
    assert "plain+norm" not in text


def test_on_cuda_the_sentinels_blocking_syncs_are_a_target_of_their_own():
    # the first GPU run settles it in its Targets table: none beyond the step's own
    reads = {
        "mlp-fp16": {"plain (cuda syncs)": 1.0, "sentinel (cuda syncs)": 1.0},
        "mlp-fp32": {"plain (cuda syncs)": 0.0, "sentinel (cuda syncs)": 1.0},
        "transformer-bf16": {"plain": 11.0, "sentinel": 12.0},  # a CPU run: no such row
    }
    assert _sync_targets(reads) == [
        ("`sentinel` blocking syncs per step beyond the plain loop's, mlp-fp16", "+0", "+0", True),
        ("`sentinel` blocking syncs per step beyond the plain loop's, mlp-fp32", "+1", "+0", False),
    ]


def test_the_page_says_half_precision_is_emulated_only_where_it_is():
    native = " ".join(_flags({"avx2": True, "avx512_bf16": True, "avx512_fp16": False}))
    assert "multiplies bfloat16 in hardware" in native
    assert "not float16 (no avx512_fp16)" in native
    emulated = " ".join(_flags({"avx2": True, "avx512_bf16": False, "amx_bf16": False}))
    assert "the CPU emulates bfloat16" in emulated
    assert _flags(None) == []  # a machine whose flags could not be read: no claim


def test_the_medians_interval_is_read_from_the_order_statistics():
    # 30 rounds: fewer than 10 of 30 values fall below the median with probability
    # 0.021 (at most 0.025), fewer than 11 with 0.049: the 10th smallest to 10th largest
    assert median_interval([float(i) for i in range(1, 31)]) == (10.0, 21.0)
    assert median_interval([5.0, 1.0, 4.0, 2.0, 3.0]) == (1.0, 5.0)  # too few: the range
    spread = Spread.of([1.02, 1.05, 1.01, 1.04, 1.03])
    assert (spread.median, spread.low, spread.high) == (1.03, 1.01, 1.05)


def test_the_medians_interval_holds_the_true_median_95_times_in_100():
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):  # skewed, as step times are: a lognormal, median exactly 1
        low, high = median_interval([rng.lognormvariate(0.0, 0.1) for _ in range(30)])
        covered += low <= 1.0 <= high
    assert 0.94 <= covered / trials <= 0.975  # 0.957 exactly, for 30 values


def test_the_targets_show_each_median_with_its_interval_and_say_which_misses_are_noise():
    ratio = {
        "sentinel": {"median": 1.06, "ci_low": 1.04, "ci_high": 1.08},  # wholly above 1.03
        "guard": {"median": 1.06, "ci_low": 1.04, "ci_high": 1.08},  # reaches down to 1.05
        "plain+norm": {"median": 1.01, "ci_low": 1.0, "ci_high": 1.02},
    }
    step = {"workload": "mlp-fp32", "ms": {"plain": {"median": 8.0}}, "ratio": ratio}
    rows = {label: measured for label, measured, _, _ in _step_targets([step])}
    assert rows["`sentinel` step time / plain, mlp-fp32"] == "1.060x (1.040–1.080)"
    text = "\n".join(_missed([step]))
    assert "the 95% interval reaches down to the target for `guard` on mlp-fp32: those" in text
    assert "`sentinel` on mlp-fp32" not in text.split("Of these")[1]


def test_a_time_to_diagnosis_shows_the_median_of_its_pairs_with_their_range():
    assert _paired({"ratio": 1.2, "ratios": [1.1, 1.2, 1.4]}) == "1.20x (1.10–1.40)"
    assert _paired({"ratio": 1.2, "ratios": [1.2]}) == "1.20x"  # one pair: no range
    assert _paired({"ratio": 1.2}) == "1.20x"  # results from before the pairs


def test_the_short_step_explanation_is_for_misses_beyond_the_noise_only():
    def step(workload: str, ms: float, low: float) -> dict:
        ratio = {"guard": {"median": 1.06, "ci_low": low, "ci_high": 1.1}}
        return {"workload": workload, "ms": {"plain": {"median": ms}}, "ratio": ratio}

    long_noisy, short_real = step("transformer-bf16", 1539.0, 0.9), step("mlp-fp32", 7.9, 1.055)
    assert "a few tenths of a millisecond" in "\n".join(_missed([long_noisy, short_real]))
    assert "a few tenths of a millisecond" not in "\n".join(_missed([long_noisy]))
    real_long = step("transformer-bf16", 1539.0, 1.055)
    assert "a few tenths of a millisecond" not in "\n".join(_missed([real_long, short_real]))


def test_the_forecast_benchmark_runs_and_rewrites_only_the_measured_part(tmp_path, capsys):
    from benchmarks.forecast import main as forecast_main

    page = tmp_path / "forecast.md"
    page.write_text(
        "# Forecast\n\nprose\n\n<!-- measured: start -->\nold\n<!-- measured: end -->\n"
    )
    args = ["--only", "seed-fp16-nan", "seed-fixed", "--out", str(page), "--size", "tiny"]
    assert forecast_main([*args, "--rounds", "1", "--steps", "1"]) == 0
    text = page.read_text()
    assert text.startswith("# Forecast\n\nprose\n\n<!-- measured: start -->") and "old" not in text
    assert "**1 of 1** growth failures forecast at least 10 steps before the failure" in text
    assert "| seed-fp16-nan | 13 | log-of-softmax | 26 | 13 | 48% | yes |" in text
    assert "| seed-fixed | 400 | yes | 0: none |" in text
    assert "| mlp-fp32 |" in text and "sentinel+forecast / sentinel" in text


def test_whole_process_targets_are_the_medians_of_the_pairs_ratios():
    from benchmarks.process import Usage, _ratios

    def usage(wall: float, sys_: float) -> Usage:
        # what each side says of its loop alone: the plain script's seconds, diagnose's run_s
        ended = {"loop_s": wall - 2.0, "timing": {"run_s": wall - 2.5}}
        return Usage(wall, wall, sys_, 400.0, 9000, ended)

    ratio = _ratios(
        {
            "plain": [usage(10.0, 1.0), usage(12.0, 1.0), usage(10.0, 2.0)],
            "plain+malloc": [usage(9.0, 0.2), usage(9.0, 0.2), usage(9.0, 0.2)],
            "diagnose": [usage(10.5, 0.3), usage(12.0, 0.3), usage(11.0, 0.3)],
        }
    )
    assert (ratio["wall"].median, ratio["wall"].low, ratio["wall"].high) == (1.05, 1.0, 1.1)
    assert round(ratio["sys"].median, 2) == 0.3
    assert round(ratio["own"].median, 3) == round(11.0 / 9.0, 3)  # over the same malloc
    loop = ratio["loop"]  # start-up and exit aside: 8 / 8, 9.5 / 10, 8.5 / 8
    assert (loop.low, loop.median, loop.high) == (0.95, 1.0, 1.0625)


def test_the_targets_table_holds_the_whole_process_rows_first():
    from benchmarks.render_process import process_targets

    def spread(median: float) -> dict:
        return {"median": median, "low": median, "high": median}

    results = {
        "process": [
            {
                "workload": "mlp-wide-fp32",
                "ratio": {"wall": spread(1.04), "sys": spread(1.2)},
            }
        ],
        "verified_process": {"workload": "mlp-wide-fp32", "ratios": [1.4, 1.7], "ratio": 1.55},
    }
    assert process_targets(results) == [
        ("`diagnose` whole process / plain script, mlp-wide-fp32", "1.040x (1.040–1.040)",
         "<= 1.05x", True),
        ("`diagnose` system time / plain script's, mlp-wide-fp32", "1.20x (1.20–1.20)",
         "<= 1.10x", False),
        ("verified time to diagnosis, whole process / plain time to the failing step, "
         "mlp-wide-fp32", "1.55x (1.40–1.70)", "<= 1.5x", False),
    ]  # fmt: skip
