"""The command lines' error boundary: a user's mistake is one line and an exit code, a bug a traceback.

Both console scripts (``device-agent`` and ``coordinator``) run their command through :func:`guarded`
with the error classes that mean "the input or the machine is not as expected" (a bad file, a port
in use, a broker that is not there, no CUDA). Anything else is a bug and keeps its traceback.
``--debug`` (or ``FEDFLEET_DEBUG=1``) shows the traceback of a user error too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_HELP = "show the full traceback of an error (also: FEDFLEET_DEBUG=1)"
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
INTERRUPTED_EXIT = 130  # 128 + SIGINT


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get("FEDFLEET_DEBUG", "") not in ("", "0")


def describe(exc: BaseException) -> str:
    """One line for a user error: an OSError's reason and file, else the exception's own text."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return str(exc).strip() or type(exc).__name__


def guarded(prog: str, run: Callable[[], int], user_errors: tuple[type[BaseException], ...], debug: bool) -> int:
    """``run()``'s exit code; a user error becomes ``prog: error: ...`` on stderr and exit 1."""
    try:
        code = run()
        sys.stdout.flush()  # a reader that went away shows up here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        _discard_stdout()
        print(f"{prog}: output closed before it was all written (broken pipe)", file=sys.stderr)
        return BROKEN_PIPE_EXIT
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except user_errors as exc:
        if debug:
            raise
        print(f"{prog}: error: {describe(exc)}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
