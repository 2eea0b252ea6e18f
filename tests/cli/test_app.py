"""The command line starts fast where users call it often: `--help`, every command's
`--help`, `schema` and `lint` (a pre-commit hook) never import torch, which alone takes
seconds to load; only the commands that run a model do. `lint` loads the causes for their
texts, not the report model behind them (docs/performance.md, Start-up)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import typer

from nandoctor.cli.app import cli_console, end_before_teardown, handles_errors
from nandoctor.setup.peers import peer_failed
from tests.helpers.paths import REPO

PROBE = """
import json
import sys
from nandoctor.cli import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
print("modules:", json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def loaded_modules(*args: str) -> set[str]:
    """Run the CLI in a fresh interpreter; the modules it had imported when it was done."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO
    )
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("modules:"), done.stderr
    return set(json.loads(line.removeprefix("modules:")))


def loads_torch(*args: str) -> bool:
    return "torch" in loaded_modules(*args)


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["diagnose", "--help"],
        ["compare", "--help"],
        ["watch", "--help"],
        ["baseline", "--help"],
        ["schema"],
        ["lint", "nandoctor/examples/seed.py"],
    ],
    ids=" ".join,
)
def test_help_schema_and_lint_never_import_torch(args):
    assert not loads_torch(*args)


def test_lint_reads_the_cause_texts_without_the_report_model():
    # the report's types and health statistics were a fifth of lint's start-up
    loaded = loaded_modules("lint", "nandoctor/examples/seed.py")
    assert "nandoctor.causes.catalog" in loaded  # the probe can tell: it loads the causes
    assert not {"nandoctor.report.types", "nandoctor.report.health"} & loaded


@pytest.mark.parametrize("args", [["--help"], ["lint", "nandoctor/examples/seed.py"]], ids=" ".join)
def test_help_and_lint_never_import_pydantic(args):
    # typer 0.29 coerces every argument through a pydantic TypeAdapter: importing pydantic
    # and building the adapters nearly doubled lint's start-up (pyproject keeps typer < 0.29)
    assert "pydantic" not in loaded_modules(*args)


def test_the_cli_prints_names_as_written_not_as_emoji_codes():
    # a batch's tensor `input:mask` printed as "input😷" (rich's emoji codes are on by default)
    console = cli_console(stderr=False)
    with console.capture() as printed:
        console.print("input:mask held 142 -inf values; see :smile:")
    assert printed.get() == "input:mask held 142 -inf values; see :smile:\n"


def test_the_cli_never_needs_the_click_package():
    """typer vends its own click: a plain install may have no `click` package at all."""
    code = "import sys; from nandoctor.cli import app; print('click' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["diagnose", "--bogus"], "No such option: --bogus"),
        (["lint", "--fail-on", "fatal", "x.py"], "Invalid value for '--fail-on': 'fatal'"),
        (["compare"], "Missing argument 'config'."),
        # NB: a budget of nan compares false with everything (watch replayed always)
        (["watch", "--replay-budget", "nan", "--", "true"], "Invalid value for '--replay-budget'"),
        (["diagnose", "x.yaml", "--time-budget", "NaN"], "Invalid value for '--time-budget'"),
        # NB: 0 was read as no budget, and the whole run ran
        (["diagnose", "x.yaml", "--time-budget", "0"], "Invalid value for '--time-budget': 0: "),
        (["baseline", "x.yaml", "--out", "b.json", "--time-budget", "-1"], "Invalid value"),
        (["diagnose", "x.yaml", "--max-headroom", "nan"], "Invalid value for '--max-headroom'"),
    ],
)
def test_a_mistyped_command_line_is_one_error_line_and_a_hint(args, error):
    """As every other usage error: one line naming the option (not click's usage, try
    and error lines), a hint, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "nandoctor", *args], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 2
    first, hint = done.stderr.strip().splitlines()
    assert first.startswith(f"error: {error}")
    assert hint.startswith("hint: ")  # NB: the program as invoked (here `python -m ...`)
    assert hint.endswith(f"nandoctor {args[0]} --help lists the options")


def test_nandoctor_alone_shows_the_help_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "nandoctor"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "nandoctor [OPTIONS] COMMAND [ARGS]..." in done.stdout + done.stderr


def test_a_command_that_runs_a_model_does_import_it(tmp_path):
    # the probe above can tell: a diagnose that reaches the config's model loads torch
    config = REPO / "configs" / "seed-fixed.yaml"
    assert loads_torch("diagnose", str(config), "--steps", "1", "--no-verify", "--quiet")


def test_a_rank_of_a_launched_job_ends_without_pythons_teardown(monkeypatch):
    # its gloo threads may still hold tensors while the interpreter is torn down, which
    # aborts the process after the report was written: the launcher would report a dead
    # rank (exit 3) instead of the diagnosis
    from nandoctor.setup import distributed  # noqa: F401  # loaded by every launched rank

    ended: list[int] = []
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    end_before_teardown(1)
    assert ended == [1]
    end_before_teardown(3)  # a rank that failed: the others must meet it in a collective
    assert ended == [1]
    monkeypatch.delenv("RANK")
    end_before_teardown(0)  # a single process ends as Python ends it
    assert ended == [1]


def test_a_peer_rank_gone_during_nandoctors_own_exchange_is_one_line_and_exit_3(
    monkeypatch, capsys
):
    # outside the user's code (a step's flags, the last barrier): the rank says another
    # rank failed, with the hint to read that rank's own error, not a traceback of ours
    import torch.distributed

    @handles_errors
    def command() -> None:
        raise torch.distributed.DistError("Connection closed by peer [127.0.0.1]:29500")

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(typer.Exit) as ended:
        command()
    assert ended.value.exit_code == 3
    err = capsys.readouterr().err
    assert "error: rank 1: another rank failed or hung during an exchange between ranks" in err
    assert "hint: that rank's own error is printed above" in err
    assert "Traceback" not in err


def test_a_closed_pipe_in_a_launched_rank_is_not_a_lost_peer(monkeypatch):
    # `diagnose --json - | head` on rank 0: this process's own pipe, not another rank;
    # gloo says "Broken pipe" too, but in torch's errors, never as an OSError
    monkeypatch.setenv("RANK", "0")
    assert not peer_failed(BrokenPipeError(errno.EPIPE, "Broken pipe"))
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:598] Write error: Broken pipe")
    assert peer_failed(gloo)
