"""The typer app, and the wrapper every command runs in: errors become messages, and
whatever the command ended with becomes its exit code (through `outcome.exit_code`).

A `NandoctorError` prints `error: <one line>` (and a hint) on stderr, no traceback;
a `UserCodeError` adds the user's frames; `--debug` re-raises to show everything.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from nandoctor.cli.outcome import Outcome, exit_code
from nandoctor.errors import NandoctorError, UserCodeError
from nandoctor.version import __version__

app = typer.Typer(
    name="nandoctor",
    help="Find the step, the tensor and the cause when a PyTorch training run turns NaN.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,  # NB: locals hold tensors and paths
    rich_markup_mode=None,
)

F = TypeVar("F", bound=Callable[..., Any])


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def handles_errors(command: F) -> F:
    """Wrap a command as pytest's `wrap_session` wraps a session: the command returns its
    `Outcome` or raises; user-fixable errors become one message; either way the exit
    code is made once, by `exit_code`."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _sigterm_as_interrupt():
                outcome = command(*args, **kwargs)
        except NandoctorError as e:
            if kwargs.get("debug"):
                raise
            print_error(e)
            outcome = Outcome(error=e)
        except KeyboardInterrupt:
            stderr_console().print("interrupted", style="yellow")
            outcome = Outcome(interrupted=True)
        except Exception as e:
            if not _peer_failure(e) or kwargs.get("debug"):
                raise
            print_peer_error(e)
            outcome = Outcome(error=e)
        raise typer.Exit(exit_code(outcome or Outcome()))

    return wrapper  # type: ignore[return-value]


def _peer_failure(error: BaseException) -> bool:
    """A peer rank died or hung (`torch.distributed.DistError`). NB: looked up only where
    torch is loaded already, so that `--help` and `lint` never import it."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(error, dist.DistError)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a cancelled CI job, `kill`) stops us like Ctrl-C: a partial report, 130."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_peer_error(error: BaseException) -> None:
    rank = os.environ.get("RANK", "?")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    stderr_console().print(f"[bold red]error:[/] rank {rank}: {escape(first)}")
    stderr_console().print("[cyan]hint:[/] another rank crashed or hung; see its output")


def print_error(error: NandoctorError) -> None:
    console = stderr_console()
    if isinstance(error, UserCodeError):
        console.print("Traceback of your code (most recent call last):", style="dim")
        for line in traceback.format_list(error.user_frames()):
            console.print(escape(line.rstrip("\n")), style="dim")
    rank = (
        f"rank {os.environ['RANK']}: "
        if "RANK" in os.environ and not error.message.startswith("rank ")
        else ""
    )
    console.print(f"[bold red]error:[/] {rank}{escape(error.message)}")
    if error.hint:
        console.print(f"[cyan]hint:[/] {escape(error.hint)}")


def version_callback(value: bool) -> None:
    if value:
        typer.echo(f"nandoctor {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=version_callback, is_eager=True, help="Show the version."
    ),
) -> None:
    """Find the step, the tensor and the cause when a PyTorch training run turns NaN."""
