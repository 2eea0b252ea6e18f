"""`nandoctor watch` changes nothing: scripts written the ways people write them
(`tests/scripts/corpus/`) run plain and watched, side by side, print the same stdout and
stderr (nandoctor's own lines aside), write the same files byte for byte (a model saved
whole included), draw the same random numbers, and exit with the same code; where one
goes non-finite, the report names the step at which the plain script first printed a
non-finite loss.

A failing script is watched with `--continue`, so that it runs to its end as it does
plain (watch's exit code is then 1, the documented "non-finite found"; a healthy one's
is the script's own). Timings are the only thing a script may print differently, and
the corpus prints none but the Trainer's own runtime, masked here.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

import nandoctor.cli.watch  # noqa: F401  (registers the command until cli/__init__ imports it)
from nandoctor.cli import app

PY = sys.executable
CORPUS = Path(__file__).resolve().parents[1] / "scripts" / "corpus"
TIMINGS = re.compile(r"('train_(?:runtime|samples_per_second|steps_per_second)': )'[^']*'")


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    files: dict[str, bytes]


def files_in(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def untimed(text: str) -> str:
    return TIMINGS.sub(r"\1'<time>'", text)


def side_by_side(
    script: str, args: list[str], tmp_path: Path, capfd, monkeypatch, options: list[str]
) -> tuple[Ran, Ran, dict]:
    """The script run plain (in a process of its own, started first) and under watch
    (in this process, as `test_watch` runs it), each in a folder of its own."""
    command = [PY, str(CORPUS / f"{script}.py"), *args]
    plain_dir, watched_dir = tmp_path / "plain", tmp_path / "watched"
    plain_dir.mkdir()
    watched_dir.mkdir()
    plain = subprocess.Popen(
        command, cwd=plain_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    report_path = tmp_path / "report.json"
    monkeypatch.chdir(watched_dir)
    capfd.readouterr()
    result = CliRunner().invoke(
        app, ["watch", "--json", str(report_path), *options, "--", *command]
    )
    out, err = capfd.readouterr()
    plain_out, plain_err = plain.communicate(timeout=600)
    assert report_path.exists(), result.output
    return (
        Ran(plain.returncode, untimed(plain_out), untimed(plain_err), files_in(plain_dir)),
        Ran(result.exit_code, untimed(out), untimed(err), files_in(watched_dir)),
        json.loads(report_path.read_text()),
    )


def without_nandoctors_lines(stderr: str) -> str:
    """The watched script's stderr less the lines nandoctor writes there itself."""
    return "".join(
        line for line in stderr.splitlines(keepends=True) if not line.startswith("nandoctor ")
    )


def assert_same_program(plain: Ran, watched: Ran) -> None:
    assert watched.stdout == plain.stdout
    assert without_nandoctors_lines(watched.stderr) == plain.stderr
    assert watched.files.keys() == plain.files.keys()
    for name, data in plain.files.items():
        assert watched.files[name] == data, f"{name} differs"
    assert "rng [" in plain.stdout  # the random streams, drawn after training, compared


def first_nonfinite_step(stdout: str) -> int | None:
    """The first step at which the script printed a non-finite value: its own account."""
    for line in stdout.splitlines():
        words = line.split()
        if words[:1] == ["step"] and any(not math.isfinite(float(w)) for w in words[3::2]):
            return int(words[1])
    return None


FAILING = [
    # script, its arguments, why it is in the corpus
    ("lm", ["--model", "LSTM", "--nan-at", "7"], "a hand-written SGD update, no optimizer"),
    ("accumulate", ["--nan-at", "13"], "gradient accumulation, 4 micro-batches a step"),
    ("gan", ["--nan-at", "9"], "two optimizers"),
    ("lbfgs", ["--nan-at", "4"], "an L-BFGS closure"),
    ("accel", ["--nan-at", "6"], "accelerate's backward and clipping"),
    ("lit", ["--nan-at", "5"], "Lightning's Trainer.fit"),
    ("compiled", ["--nan-at", "5", "--backend", "aot_eager"], "torch.compile, both forms"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "style"), FAILING, ids=[c[0] for c in FAILING])
def test_a_failing_script_runs_as_it_does_plain_and_fails_at_the_step_it_printed(
    script, args, style, tmp_path, capfd, monkeypatch
):
    plain, watched, report = side_by_side(
        script, args, tmp_path, capfd, monkeypatch, ["--continue"]
    )
    assert_same_program(plain, watched)
    assert plain.code == 0 and watched.code == 1 and report["status"] == "nonfinite"
    step = first_nonfinite_step(plain.stdout)
    assert step is not None and report["first_nonfinite"]["step"] == step, style


HEALTHY = [
    ("ema", [], "an EMA made by copy.deepcopy(model), every state dict saved, the EMA whole"),
    ("hf", [], "transformers' Trainer.train on a tiny GPT-2"),
    (
        "hooks",
        ["--backend", "aot_eager"],
        "hooks of its own, a block compiled alone, saved whole and deep-copied each epoch",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "style"), HEALTHY, ids=[c[0] for c in HEALTHY])
def test_a_healthy_script_runs_as_it_does_plain(script, args, style, tmp_path, capfd, monkeypatch):
    plain, watched, report = side_by_side(script, args, tmp_path, capfd, monkeypatch, [])
    assert_same_program(plain, watched)
    assert plain.code == watched.code == 0 and report["status"] == "healthy", style
    assert report["steps_completed"] > 0


@pytest.mark.slow
def test_a_diverging_language_model_saves_itself_whole_and_is_told_it_diverged(
    tmp_path, capfd, monkeypatch
):
    """pytorch/examples' word language model as a Transformer under AdamW at lr 20: its
    own `torch.save(model, f)` raised under watch ("cannot pickle 'WeakIdRef' object"),
    and its loss, 4 to ~5e3 at step 1, finite, got no word of divergence."""
    args = ["--model", "Transformer", "--use-optimizer", "--lr", "20"]
    plain, watched, report = side_by_side("lm", args, tmp_path, capfd, monkeypatch, [])
    assert_same_program(plain, watched)
    assert plain.code == watched.code == 0 and report["status"] == "healthy"
    # the script loaded its saved model back, as plain: the same file, nothing of ours in it
    assert "| end of training | valid loss" in watched.stdout
    assert b"nandoctor" not in watched.files["model.pt"]
    (diverged,) = [e for e in report["events"] if e["kind"] == "divergence"]
    assert (diverged["step"], diverged["metric"]) == (1, "loss")
    assert report["summary"].endswith(", but the loss diverged at step 1")
