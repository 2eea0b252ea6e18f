"""The benchmark runs end to end at tiny sizes, so it cannot rot. It asserts that it
runs and reports every figure, not its timings (those belong to docs/performance.md)."""

from __future__ import annotations

from benchmarks.run import main


def test_the_benchmark_runs_at_tiny_sizes(capsys, tmp_path):
    results = tmp_path / "results.json"
    args = ["--size", "tiny", "--rounds", "1", "--steps", "1", "--failing-step", "4"]
    args += ["--verified-workload", "mlp-fp16", "--verified-failing-step", "40"]
    args += ["--workloads", "mlp-fp16", "--out", "-", "--json", str(results)]
    assert main(args) == 0
    page = capsys.readouterr().out
    for heading in (
        "## Targets",
        "## Step time",
        "## Host reads per step",
        "## Time to diagnosis",
        "## Snapshot memory",
    ):
        assert heading in page
    assert "nandoctor found: step 4, phase input" in page
    assert "nandoctor found: step 40, phase input" in page
    assert "- nonfinite-input: with batches holding NaN or inf skipped, applied from step" in page
    assert "`sentinel` step time / plain, mlp-fp16" in page
    assert results.read_text().startswith("{")
