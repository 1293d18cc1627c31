"""harness/cli.py: what every command line of the project shares: a bad flag is one error line (`OneLineParser`), and
the argparse type of a count (`int_at_least`). A runtime module: a reader of the recipe may skip it.

It imports nothing of the project, so that every entry point (train.py through harness/flags.py, `pipeline_rl.py
replica`, scaling_fit.py, harness/bench.py, harness/teach.py, harness/tasks.py) can use it without pulling in torch or
making an import cycle.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


class OneLineParser(argparse.ArgumentParser):
    """Argument errors in one line, printed once: no usage block above it, since the line already names the flag
    and says what it expected. Under torchrun every rank parses the same flags, so only rank 0 speaks and the others
    exit quietly with the same status. Subcommands' parsers are of this class too (argparse makes them with the
    parent's class)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def int_at_least(minimum: int, none: bool = False) -> Callable[[str], int | None]:
    """An argparse type: an integer >= minimum (`none`: or the word none), so that a bad value is one line naming its
    flag instead of a traceback later."""
    def count(text: str) -> int | None:
        if none and text == "none":
            return None
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer{' or none' if none else ''}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value
    return count


def positionals(prog: str, names: tuple[str, ...], argv: list[str], description: str | None = None) -> list[str]:
    """A subcommand's positional arguments (`train.py export RUN_DIR OUT_DIR`), checked like flags: one missing, one
    extra or an unknown option is one line and exit status 2, and `--help` prints `description`."""
    parser = OneLineParser(prog=prog, description=description)
    for name in names:
        parser.add_argument(name)
    given = vars(parser.parse_args(argv))
    return [given[name] for name in names]
