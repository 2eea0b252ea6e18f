"""The typer app, and the wrapper every command runs in: errors become messages, and
whatever the command ended with becomes its exit code (through `outcome.exit_code`).

A `NandoctorError` prints `error: <one line>` (and a hint) on stderr, no traceback;
a `UserCodeError` adds the user's frames; `--debug` re-raises to show everything.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar, cast

import typer
from rich.console import Console
from rich.markup import escape

from nandoctor.cli.outcome import Outcome, exit_code
from nandoctor.cli.output import report_stream
from nandoctor.errors import (
    ExitCode,
    NandoctorError,
    PeerFailure,
    ProcessExit,
    UsageError,
    UserCodeError,
    UserExit,
    memory_message,
    out_of_memory,
)
from nandoctor.setup.peers import peer_failed, peer_failure
from nandoctor.setup.torch_globals import forget_torch_globals
from nandoctor.user_files import is_user_file
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

# click's ClickException. NB: found through typer, whose click is a private copy since
# typer 0.2x (the `click` package may not even be installed); Any, as typer types it
_CLICK_ERROR: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
# How click ends a command with a code of its own
CLICK_ENDINGS: tuple[type[BaseException], ...] = (typer.Exit, typer.Abort, _CLICK_ERROR)


def run_app() -> int:
    """The app as the `nandoctor` command runs it, its exit code returned. A usage error
    of click's own (an unknown option, a missing argument, a value of the wrong kind) is
    one line naming the option, as nandoctor's are, not click's usage, try and error
    lines; `nandoctor` alone shows the help, as click does (exit 2)."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        stderr_console().print("Aborted!")
        return 1
    except _CLICK_ERROR as e:
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()
        else:
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path} --help" if ctx is not None else "nandoctor --help"
            print_error(UsageError(e.format_message(), hint=f"{where} lists the options"))
        return e.exit_code
    return code if isinstance(code, int) else 0


class _CliConsole(Console):
    def on_broken_pipe(self) -> None:
        """`nandoctor lint . | head` closed stdout: print nothing more, and let the command
        finish with its own exit code (rich's default raised SystemExit(1), which read as
        the user's code ending the run, exit 3)."""
        self.quiet = True
        _stdout_to_devnull()


def cli_console(*, stderr: bool, soft_wrap: bool = False) -> Console:
    """Every console of the CLI. It prints what it is given: no emoji codes (a batch's
    `input:mask` is a tensor's name, not an emoji) and no highlighting of numbers and
    paths (the renderers choose every style)."""
    return _CliConsole(stderr=stderr, highlight=False, soft_wrap=soft_wrap, emoji=False)


def stderr_console() -> Console:
    return cli_console(stderr=True, soft_wrap=True)


def handles_errors(command: F) -> F:
    """Wrap a command as pytest's `wrap_session` wraps a session: the command returns its
    `Outcome` or raises; user-fixable errors become one message; either way the exit
    code is made once, by `exit_code`."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        forget_torch_globals()
        try:
            with _sigterm_as_interrupt(), _os_exit_raises(), _user_prints_off_stdout(kwargs):
                outcome = command(*args, **kwargs)
        except NandoctorError as e:
            if kwargs.get("debug"):
                raise
            if not _announce(e):
                print_error(e)
            outcome = Outcome(error=e)
        except KeyboardInterrupt:
            stderr_console().print("interrupted", style="yellow")
            outcome = Outcome(interrupted=True)
        except CLICK_ENDINGS:  # click's own ending: its code stands
            raise
        except (Exception, SystemExit) as e:  # NB: never exit 1 ("non-finite") for these
            if kwargs.get("debug"):
                raise
            error = unexpected_error(e)
            print_error(error)
            outcome = Outcome(error=error)
        raise typer.Exit(exit_code(outcome or Outcome()))

    return cast(F, wrapper)


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


@contextlib.contextmanager
def _os_exit_raises() -> Iterator[None]:
    """`os._exit(n)` called by the user's code in this process and thread (a model, a
    loss, a data builder) raises `ProcessExit` instead, so the run ends with its exit code
    and message (3) rather than vanishing with whatever code it chose. Other processes (a
    DataLoader's workers, forked from here) and threads still exit for real."""
    real, pid, main = os._exit, os.getpid(), threading.main_thread()

    def exit_(status: int) -> NoReturn:
        if os.getpid() == pid and threading.current_thread() is main:
            raise ProcessExit(status)
        real(status)

    os._exit = exit_
    try:
        yield
    finally:
        os._exit = real


REPORT_OPTIONS = ("json_path", "markdown_path", "junit_path", "sarif_path", "plot_path", "out")


@contextlib.contextmanager
def _user_prints_off_stdout(kwargs: dict[str, Any]) -> Iterator[None]:
    """With a report on stdout (`--json -`), everything else printed in this process (the
    user's own prints too) goes to stderr, so that stdout stays one parseable report."""
    if not any(kwargs.get(name) == "-" for name in REPORT_OPTIONS):
        yield
        return
    with report_stream(sys.stdout), contextlib.redirect_stdout(sys.stderr):
        yield


def unexpected_error(error: BaseException) -> NandoctorError:
    """An exception no module turned into a message: the environment's (a full disk, a
    missing permission, out of memory; exit 2), the user's code's (raised from a user
    frame, or a `SystemExit` outside our wrappers; exit 3), or nandoctor's own bug (exit
    2, "internal error"). Never exit 1: that would tell CI a NaN was found."""
    if isinstance(error, SystemExit):
        return UserExit("your code", error)
    if peer_failed(error):  # nandoctor's own collective (a step's flags, the last barrier)
        return peer_failure(error, "an exchange between ranks")
    if isinstance(error, BrokenPipeError):  # `| head` closed stdout: nothing more to say there
        _stdout_to_devnull()
    if isinstance(error, OSError):
        return environment_error(error)
    if isinstance(error, RuntimeError) and str(error).startswith("Symlink loop from "):
        # NB: pathlib's resolve() says ELOOP so before Python 3.13
        where = str(error).removeprefix("Symlink loop from ").strip("'")
        return UsageError(f"a symbolic link that leads to itself: {where}", hint=_LOOP_HINT)
    if out_of_memory(error):
        return UsageError(
            f"out of memory: {memory_message(error)}",
            hint="try fewer --steps, a smaller batch, or snapshot: {every: N} with a larger N",
        )
    if not isinstance(error, RecursionError) and _raised_in_user_code(error):
        return UserCodeError("your code", error)
    return UsageError(
        f"internal error: {type(error).__name__}: {first_line(error)}",
        hint="this is a bug in nandoctor: please report it with the output of --debug",
    )


_LOOP_HINT = "the link (or one it points to) points back to itself: fix or remove it"


def _stdout_to_devnull() -> None:
    """Python flushes stdout once more at exit; a closed pipe would print a traceback."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def environment_error(error: OSError) -> UsageError:
    """A file-system or OS failure as one line naming the file (exit 2)."""
    where = f": {error.filename}" if error.filename else ""
    reason = error.strerror or first_line(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return UsageError(f"no space left on the device{where}", hint="free some disk space")
    return UsageError(f"{reason}{where}", hint="--debug shows where it happened")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _raised_in_user_code(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and is_user_file(frames[-1].filename)


def end_before_teardown(code: object) -> None:
    """Exit now, with `code`, skipping Python's finalization, where it cannot end well:
    threads the user's code started (not daemons) are still running, for which Python
    would wait forever after our report was written; or this process is a rank of a
    launched job, whose gloo threads may still hold tensors while the interpreter is torn
    down ("terminate called without an active exception": the launcher would then report
    a dead rank, exit 3, after the diagnosis was written). Output is flushed first;
    nothing of nandoctor's is left to do.

    NB: only a rank that reached its verdict (exit 0 or 1). One that failed ends as Python
    ends it: dying at once, it would have the launcher stop the others (SIGTERM, an
    interrupt: a report) before their collectives fail on the lost peer (one line each,
    no report, the job's exit 3)."""
    main = threading.main_thread()
    alive = [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
    if alive:
        names = ", ".join(t.name for t in alive[:3])
        stderr_console().print(
            f"[dim]nandoctor: ending {len(alive)} thread(s) your code left running ({names})[/]"
        )
    elif not (_a_launched_rank() and code in (ExitCode.HEALTHY, ExitCode.NONFINITE, None)):
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _a_launched_rank() -> bool:
    """A rank started by torchrun's launcher. NB: asked only where the job's code was
    loaded, so that `--help` and `lint` never import torch."""
    distributed = sys.modules.get("nandoctor.setup.distributed")
    return distributed is not None and bool(distributed.under_launcher())


def _announce(error: NandoctorError) -> bool:
    """A rank of a data-parallel job tells the job why it fails (`distributed.announce_failure`):
    rank 0, stopped by the launcher because of it, reports that, not an interrupt. True
    when another rank said the same already (its line stands for both). NB: not a peer
    found gone: that rank's own error (or an interrupt: Ctrl-C) is the reason."""
    if isinstance(error, PeerFailure) and not error.hung:
        return False
    if "RANK" not in os.environ or "torch.distributed" not in sys.modules:  # NB: no torch here
        return False
    from nandoctor.setup.distributed import announce_failure

    named = error.message.startswith("rank ")  # NB: a hang's: each rank's own line
    return announce_failure(_ranked(error.message)) and not named


def _ranked(message: str) -> str:
    """The message as a rank of a data-parallel job says it: `rank 1: ...`."""
    if "RANK" in os.environ and not message.startswith("rank "):
        return f"rank {os.environ['RANK']}: {message}"
    return message


def print_error(error: NandoctorError) -> None:
    console = stderr_console()
    frames = error.user_frames() if isinstance(error, UserCodeError) else []
    if frames:
        console.print("Traceback of your code (most recent call last):", style="dim")
        for line in traceback.format_list(frames):
            console.print(escape(line.rstrip("\n")), style="dim")
    console.print(f"[bold red]error:[/] {escape(_ranked(error.message))}")
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
