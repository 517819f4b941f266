"""The `specdec` command: argument parsing and printing only; the work happens in the package."""
from __future__ import annotations

import argparse
import signal
import sys

from ..errors import SpecdecError
from .bench import add_bench_parser
from .check import add_check_parser
from .cost import add_calibrate_parser, add_simulate_parser
from .files import add_cache_parser, add_export_parser, add_pair_parser
from .generate import add_generate_parser
from .serve import add_serve_parser
from .train import add_longrun_parser, add_train_parser


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    p.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    add_train_parser(sub)
    add_longrun_parser(sub)
    add_generate_parser(sub)
    add_calibrate_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_simulate_parser(sub)
    add_check_parser(sub)
    add_export_parser(sub)
    add_pair_parser(sub)
    add_cache_parser(sub)
    for command in sub.choices.values():
        command.formatter_class = ShownDefaults
    return p


class ShownDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is none
    to show (a flag that is off, or a value that falls back to something the help names)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Stop:
    """SIGTERM and Ctrl-C (SIGINT) for a command: a KeyboardInterrupt in the main thread, but never
    inside an import. A KeyboardInterrupt there is lost or fatal later (numpy's import swallows it,
    a half-imported torch or numpy aborts the process or refuses to load again), so a signal that
    comes while importing waits: an interval timer (SIGALRM) delivers it again every RETRY seconds
    until the import is over. `close` stops the timer and puts the previous handlers back."""
    RETRY = 0.05

    def __init__(self):
        self.received: list[int] = []
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}

    def handle(self, signum, frame) -> None:
        if signum != signal.SIGALRM:
            self.received.append(signum)
        if not self.received:  # an alarm that is not ours: nothing to deliver
            return
        if importing(frame):
            signal.setitimer(signal.ITIMER_REAL, self.RETRY)
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise KeyboardInterrupt

    def close(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def importing(frame) -> bool:
    """Whether the main thread, at `frame`, is inside an import (its stack crosses importlib)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def main(argv: list[str] | None = None) -> int:
    """Run one command; a SIGTERM or Ctrl-C at any moment once specdec runs (its imports included)
    ends with one line naming the command and the signal, exit status 143 (SIGTERM) or 130 (Ctrl-C)."""
    stop = Stop()  # before the heavy imports (torch, with the parser's presets)
    try:
        return run(argv)
    except KeyboardInterrupt:  # ours, or the second signal of a command that handles the first (train)
        for s in stop.previous:
            signal.signal(s, signal.SIG_IGN)  # the line is the last word, whatever else arrives now
        term = (stop.received[-1] if stop.received else signal.SIGINT) == signal.SIGTERM
        words = [w for w in (sys.argv[1:] if argv is None else argv) if not w.startswith("-")]
        print(f"specdec: {words[0] + ' ' if words else ''}stopped by {'SIGTERM' if term else 'Ctrl-C'}",
              file=sys.stderr)
        return 143 if term else 130
    finally:
        stop.close()


def run(argv: list[str] | None) -> int:
    """The command's own exit status (check's verdict), else 0; 2 with one line for a SpecdecError
    or an unwritable or full disk."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or a folder we may not write, wherever it happens: say so plainly
        from ..lm.atomic import DENIED, FULL
        if e.errno not in FULL | DENIED:
            raise
        print(f"specdec: error: {e.strerror}: {e.filename or 'a file'}; "
              f"{'free some space or write elsewhere' if e.errno in FULL else 'use files and folders you may access'} "
              "(e.g. another --out)", file=sys.stderr)
        return 2

