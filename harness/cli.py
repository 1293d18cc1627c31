"""harness/cli.py: what every command line of the project shares: a bad flag is one error line (`OneLineParser`),
the argparse types of a text, a path, a directory and a file written into, a figure's file, a count, a number and a
list of integers (`text_value`, `path_text`, `path_value`, `directory_path`, `output_file`, `figure_path`,
`int_at_least`, `number`, `int_list`), a quiet end when the reader of the output stops reading (`exit_with`), the
Git LFS pointers of a hub repository cloned without git-lfs named (`git_lfs_pointers`), and under torchrun the error
that stopped a rank handed to torchrun's failure summary (`note_error_lines`, `torchrun_error_file`) and, before the
ranks have joined their process group, to the ranks waiting for it (`start_store`, `tell_the_other_ranks`). A runtime
module: a reader of the recipe may skip it.

It imports nothing of the project, so that every entry point (train.py through harness/flags.py, `pipeline_rl.py
replica`, scaling_fit.py, tools/bench.py, tools/experiments.py, tools/teach.py, harness/tasks.py,
harness/base_model.py) can use it without pulling in torch or making an import cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NoReturn


# How long a rank other than 0 waits before it exits on an error that rank 0 reports (a bad flag, a bad data row, a
# refused output directory): every rank meets the same error, and rank 0, which says what is wrong, may come to it
# seconds later on a loaded machine.
QUIET_RANK_GRACE_S = 20.0


def wait_for_a_signal(seconds: float, until: Callable[[], bool] | None = None) -> bool:
    """Sleep up to `seconds`; a SIGTERM or SIGINT ends the sleep early (True), the previous handlers back after, and
    so does `until` (False), asked at each poll. Polls, since a signal may be delivered to another thread (gloo's),
    where it would not interrupt a sleep here. Outside the main thread, where no handler can be set, it sleeps the
    whole time."""
    deadline = time.monotonic() + seconds
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return False
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not received and time.monotonic() < deadline and not (until is not None and until()):
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(received)


class RankStop(SystemExit):
    """SystemExit(code) on every rank for an error whose line (`message`) rank 0 prints: another rank keeps it for
    quiet_rank_exit, which prints it where torchrun did not end the rank (another node than rank 0's)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message


def quiet_rank_exit(code: int, wait: bool = True, message: str | None = None) -> NoReturn:
    """How a rank other than 0 exits, with status `code`, on an error that rank 0 reports. Had it exited first,
    torchrun would have ended rank 0 before rank 0 had said why (seen on CI: a run ended with torchrun's traceback
    only), so it first waits, up to QUIET_RANK_GRACE_S, for the SIGTERM that torchrun sends every rank once rank 0
    has exited. `wait=False` where a signal stopped the run: torchrun is then ending every rank itself. A wait that
    no signal ends happens on several nodes: torchrun ends the ranks of rank 0's node only, and rank 0 may not have
    met this rank's error at all (a --dataset that is not on this node), waiting in a collective for its process
    group's timeout instead. So the first rank of this node prints `message` (the rank's own error: an argument's,
    a data file's), with its rank and host. A rank that stops before the ranks join (a flag check, a data file) need
    not wait so long: the start store says at once whether rank 0 went past that check (this node's files differ:
    the line now, where it came 20 s on and rank 0 waited for it) or stopped with its own line (the line then says
    so, at the wait's end)."""
    speaks = bool(message) and os.environ.get("LOCAL_RANK", "0") == "0"  # (the node's others wait for the signal)
    rank0 = Rank0BeforeJoining(speaks and wait)
    if wait and not wait_for_a_signal(QUIET_RANK_GRACE_S, until=rank0.joined) and speaks:
        where = {"joined": ": rank 0 went past this check, so this node sees another file or setting than rank 0's",
                 "stopped": f", {QUIET_RANK_GRACE_S:g} s on: rank 0 stopped too, its own line on its node"}.get(
            rank0.state, f", {QUIET_RANK_GRACE_S:g} s on: where rank 0 has not stopped on the same error, this node "
            "sees another file or setting than rank 0's")
        print(f"{message} [rank {os.environ.get('RANK')} on {socket.gethostname()}{where}]", file=sys.stderr,
              flush=True)
    raise SystemExit(code)


class Rank0BeforeJoining:
    """Where rank 0 stands, for a rank that stops before it joined its process group, read from the start store
    (start_store): `state` is "joined" once rank 0 has counted itself in (runtime.wait_for_every_rank: it went past
    the check this rank stopped on), "stopped" once it has stopped with its line (tell_the_other_ranks), and ""
    until then, outside torchrun, or once this rank's process group is up (rank 0 is in it whatever happened)."""

    def __init__(self, ask: bool = True) -> None:
        self.store = start_store() if ask and before_joining() else None
        self.state = ""

    def joined(self) -> bool:
        """Whether rank 0 has joined (one look at the store, which notes a stop too). A rank 0 that stopped is not
        an end of the wait: it marks the store before it writes torchrun's error file, which a rank that left at
        once could have torchrun end it before."""
        if self.store is not None and not self.state:
            with contextlib.suppress(RuntimeError):  # (the store gone: nothing known, the wait runs out)
                self.state = ("stopped" if self.store.check(["rank0-stopped"]) else
                              "joined" if self.store.check(["process/0"]) else "")
        return self.state == "joined"


def exit_with(main: Callable[[], int | None]) -> NoReturn:
    """Run a command's `main` and exit with its status. When the reader of its output stops reading (`| head`), the
    command ends there, quietly and with status 1, as Python's documentation advises, instead of with a
    BrokenPipeError traceback (or, when the closed pipe is met only as the interpreter flushes at exit, a message).
    A BrokenPipeError of another pipe (a child process that died) keeps its traceback."""
    try:
        status = main()
        sys.stdout.flush()  # here, inside the try: a closed pipe met by the interpreter's own flush is not caught
    except BrokenPipeError as error:
        if not quiet_if_reader_gone(error):
            raise
        status = 1
    sys.exit(status)


def quiet_if_reader_gone(error: BaseException) -> bool:
    """Whether `error` is a BrokenPipeError met because the reader of stdout is gone (the pipe's read end closed:
    poll says POLLERR), not one of another pipe or socket. If so, stdout is pointed at /dev/null, so that the
    exit's flush of what is left in its buffer writes nowhere instead of failing again."""
    if not isinstance(error, BrokenPipeError):
        return False
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll on this system, or a stdout without a descriptor
        return False
    if gone:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


class ErrorLineNoter:
    """A rank's stderr under torchrun (`note_error_lines`): written through as it is, noting the last line that says
    "PROG: error: ..." (`line`), the one line a rank prints before it stops on a bad flag, file or state, so that
    `torchrun_error_file` can hand it to torchrun's failure summary."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.line, self._unfinished = stream, "", ""

    def write(self, text: str) -> int:
        lines = re.split(r"[\r\n]", self._unfinished + text)
        self._unfinished = lines.pop()[-4096:]  # a line still being written, or a progress bar's redraw
        self.line = next((line for line in reversed(lines) if ": error: " in line), self.line)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, buffer, ...: the stream's own
        return getattr(self.stream, name)


def note_error_lines() -> None:
    """Under torchrun (which gives each worker TORCHELASTIC_ERROR_FILE), note the error lines written to stderr."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE") and not isinstance(sys.stderr, ErrorLineNoter):
        sys.stderr = ErrorLineNoter(sys.stderr)  # type: ignore[assignment]


def torchrun_error_file(stop: BaseException, code: int) -> None:
    """What ended a torchrun worker with status `code` != 0, written to the error file torchrun gave it: torchrun's
    failure summary, the last thing a user reads (and, across nodes, the launcher's record of a rank whose output
    is on another node), shows it as the root cause, where it said "To enable traceback see: https://...". The one
    error line the rank printed (`note_error_lines`) or SystemExit's message, in the file's plain form (a "message"
    text and a "timestamp"); an exception through torch's own ErrorHandler, with its traceback (call it inside the
    except block). The other ranks are told too (tell_the_other_ranks). Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or code == 0:
        return
    if not isinstance(stop, SystemExit):
        tell_the_other_ranks("")
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        with contextlib.suppress(Exception):
            ErrorHandler().record_exception(stop)
        return
    line = stop.code if isinstance(stop.code, str) else getattr(sys.stderr, "line", "")
    tell_the_other_ranks(line.strip())
    if line:  # a rank that exits quietly (rank 0 speaks for it) has none: torchrun names its status
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps({"message": line.strip(), "timestamp": int(time.time())}))


# ----------------------------------------------------------------------------------------------------------------
# Before the process group: a rank that stops tells the ranks waiting for it (torchrun's store)
# ----------------------------------------------------------------------------------------------------------------

STORE_CONNECT_S = 5.0  # a connect to node 0's torchrun (milliseconds on a cluster's network)


def start_store() -> Any | None:
    """This torchrun attempt's part of the launcher's key-value store, the one every rank's process group is set up
    through (TORCHELASTIC_USE_AGENT_STORE: on every node, the store of node 0's torchrun); None outside torchrun or
    where it cannot be reached. Reached first by a plain connect of STORE_CONNECT_S: a rank that stops after node
    0's torchrun has gone (its node lost) asks too, and torch's client retried its connect for twice its timeout
    (a minute), printing C++ frames at each try, before it gave up."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist  # here, not at the top: only a torchrun rank asks, and it has torch

    try:
        address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        socket.create_connection(address, timeout=STORE_CONNECT_S).close()
        store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=30))
    except (KeyError, ValueError, OSError, RuntimeError):  # (torch's DistError is a RuntimeError)
        return None
    return dist.PrefixStore(f"scalerl/start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def before_joining() -> bool:
    """Whether this process is a rank that has not joined its process group (yet): torch's distributed package
    loaded, no process group up. A process that never imported torch joins nothing."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and not distributed.is_initialized()


def tell_the_other_ranks(line: str) -> None:
    """What a rank that stops with an error (its one `line`, "" where it has none) leaves in the start store, in one
    connection to it. Rank 0 marks that it said why it stops, so that no other rank says it for it
    (runtime.rank0_killed). A rank that stops with a line before it joined its process group leaves the line, where
    the others, waiting to join (runtime.wait_for_every_rank), read it: without it a rank whose node lacked a file
    that rank 0's has (a --model, a --lr typed on one node's command line) stopped in its flag checks, and rank 0
    waited in its process group's set-up for torch's timeout, 30 minutes on CPU, over an hour on GPU. The first line
    stays."""
    rank = int(os.environ.get("RANK", "0"))
    leaves_line = bool(line) and before_joining()
    if (rank != 0 and not leaves_line) or (store := start_store()) is None:
        return
    with contextlib.suppress(RuntimeError):
        if rank == 0:
            store.set("rank0-stopped", "1")
        if leaves_line:
            store.compare_set("stopped", "", json.dumps({"rank": rank, "host": socket.gethostname(), "line": line}))


class OneLineParser(argparse.ArgumentParser):
    """Argument errors in one line, printed once: no usage block above it, since the line already names the flag
    and says what it expected. Under torchrun every rank parses the same flags, so only rank 0 speaks and the others
    exit quietly with the same status. Subcommands' parsers are of this class too (argparse makes them with the
    parent's class). Run as `python -m harness.MODULE` or `python -m tools.MODULE`, its name is that command
    (argparse before Python 3.14 says MODULE.py, a file the user never named)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("prog") is None and not args:
            module = getattr(sys.modules["__main__"], "__spec__", None)
            if module is not None and module.name.startswith(("harness.", "tools.")):
                kwargs["prog"] = f"python -m {module.name}"
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        line = f"{self.prog}: error: {message} (see --help)"
        if os.environ.get("RANK", "0") != "0":
            quiet_rank_exit(2, message=line)
        print(line, file=sys.stderr)
        raise SystemExit(2)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, as argparse's formatter writes it, except where there is none to give (None:
    "(default: None)" under a required flag, or one whose default is worked out) or where the help already says it
    (it read "(default: the embedded tiny model ...) (default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text.lower():
            return text
        return super()._get_help_string(action) or text


def text_value(text: str) -> str:
    """An argparse type of a text flag (a path, a name, a list): not empty, since an empty value would silently mean
    the default (or, for a path, the current directory), and no NUL byte, which no path or name may hold."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{text!r} holds a NUL byte")
    return text


def path_text(text: str) -> str:
    """An argparse type of a path flag kept as text (as args.json keeps it): a text_value whose leading ~ is the home
    directory. The shell reads ~ so in `--out ~/x`, but not in `--out=~/x`, where the word stays as it is: a
    directory named ~ would be made here, one `rm -rf ~` away from deleting the home directory."""
    return os.path.expanduser(text_value(text))


def figure_path(text: str) -> str:
    """An argparse type of a figure's file: path_text, ending in a kind matplotlib writes (.png, .pdf, .svg, ...),
    so that a figure drawn after minutes of work is not refused then, in a traceback (`--out fit.txt`)."""
    path = path_text(text)
    from matplotlib.backend_bases import FigureCanvasBase  # here: the commands that draw import it anyway

    kinds = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().removeprefix(".") not in kinds:
        raise argparse.ArgumentTypeError(f"expected a figure file ending in .png, .pdf, .svg or another kind "
                                         f"matplotlib writes ({', '.join(sorted(kinds))}), got {text!r}")
    return path


def output_file(text: str) -> str:
    """An argparse type of a file a command writes once its work is done (a benchmark's results): path_text, not a
    directory nor under a file, refused before the work rather than in a traceback after it. `write_output` writes it,
    making its directory first."""
    path = Path(path_text(text))
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file to write")
    if (parent := nearest_existing(path.parent)) is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} lies under {parent}, a file; expected a file to write")
    return str(path)


def write_output(path: str | Path, text: str) -> None:
    """Write `text` to an output_file's path, making its directory first."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def directory_path(text: str) -> Path:
    """An argparse type of a directory a command writes into (made if missing): path_value, refused in one line where
    a file is, or lies on its way, rather than met by mkdir's FileExistsError traceback after the work."""
    path = path_value(text)
    if (blocker := nearest_existing(path)) is not None and not blocker.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {blocker} is a file; expected a directory")
    return path


def no_model_config(model: str | Path) -> str:
    """The words for a local --model directory without config.json: a run's output directory (args.json, a checkpoint)
    is named as one, with the command that makes its policy a model directory."""
    run = any((Path(model).expanduser() / name).exists() for name in ("args.json", "checkpoint", "checkpoint.old"))
    return f"{model} has no config.json: not a Hugging Face model directory" + (
        "; it is a run's directory: `python train.py export RUN_DIR OUT_DIR` makes its policy one, and `python "
        "train.py evaluate --resume RUN_DIR` evaluates it" if run else "")


GIT_LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"  # how a Git LFS pointer file begins


def git_lfs_pointers(files: list[Path]) -> str | None:
    """For `files` of which some are Git LFS pointers, the words that say so: a hub repository cloned without git-lfs
    holds a text file of about 130 bytes in place of each large file (weights, a big tokenizer.json, Parquet data),
    which each reader then calls corrupt in its own words. None when none is one."""
    pointers = []
    for file in files:
        try:
            if file.is_file() and file.stat().st_size < 1024 and file.read_bytes().startswith(GIT_LFS_POINTER):
                pointers.append(str(file))
        except OSError:  # unreadable: its reader will say so
            continue
    if not pointers:
        return None
    return (f"{', '.join(sorted(pointers))} {'is a Git LFS pointer' if len(pointers) == 1 else 'are Git LFS pointers'}"
            ", not the file itself: the repository was cloned without git-lfs; run `git lfs install && git lfs pull`"
            " in the clone")


def nearest_existing(path: Path) -> Path | None:
    """`path`, or its nearest ancestor, whichever exists first: what mkdir would meet on the way to `path`."""
    return next((p for p in (path, *path.absolute().parents) if p.exists()), None)


def repeated(items: list) -> list:
    """The items given more than once, sorted: a seed or a variant given twice would count one run twice."""
    return sorted({item for item in items if items.count(item) > 1})


def path_value(text: str) -> Path:
    """An argparse type of a path flag: path_text, as a Path."""
    return Path(path_text(text))


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


def number(low: float = -math.inf, high: float = math.inf, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (`above`: in (low, high]); inf and nan are refused, since
    they would pass every range check and then poison what reads them."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            bounds = ([f"{'>' if above else '>='} {low:g}"] if low > -math.inf else []) + \
                     ([f"<= {high:g}"] if high < math.inf else [])
            raise argparse.ArgumentTypeError(f"expected a finite number{' ' if bounds else ''}{' and '.join(bounds)}, "
                                             f"got {text!r}")
        return value
    return number


def int_list(minimum: int, pair: bool = False, distinct: bool = False) -> Callable[[str], str]:
    """An argparse type that checks a comma-separated list of integers >= minimum (`pair`: LOW,HIGH with LOW <=
    HIGH; `distinct`: none twice, for a list of seeds or runs, where a repeat would count one run twice) and keeps
    its text, which the command reads."""
    def int_list(text: str) -> str:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        if pair and (len(values) != 2 or values[0] > values[1]):
            raise argparse.ArgumentTypeError(f"expected LOW,HIGH with LOW <= HIGH, got {text!r}")
        if min(values) < minimum:
            raise argparse.ArgumentTypeError(f"each must be >= {minimum} (got {text!r})")
        if distinct and (twice := repeated(values)):
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice (got {text!r})")
        return text
    return int_list


def positionals(prog: str, names: tuple[str, ...], argv: list[str], description: str | None = None) -> list[str]:
    """A subcommand's positional arguments (`train.py export RUN_DIR OUT_DIR`), checked like flags: one missing, one
    extra or an unknown option is one line and exit status 2, and `--help` prints `description`."""
    parser = OneLineParser(prog=prog, description=description)
    for name in names:
        parser.add_argument(name)
    given = vars(parser.parse_args(argv))
    return [given[name] for name in names]


# A command made of named subcommands, each (the function that runs it and returns its results, the function that
# adds its flags, its one-line help): the benchmarks' and the experiments' tables.
Subcommands = Mapping[str, tuple[Callable[[argparse.Namespace], Any], Callable[[argparse.ArgumentParser], None], str]]


def subcommand_parser(description: str, commands: Subcommands, metavar: str) -> OneLineParser:
    """A parser with one subcommand per entry of `commands`, each with its own flags; the chosen name is read back
    as args.<metavar in lower case>."""
    parser = OneLineParser(description=description)
    subparsers = parser.add_subparsers(dest=metavar.lower(), required=True, metavar=metavar)
    for name, (_, add_args, help_text) in commands.items():
        add_args(subparsers.add_parser(name, help=help_text, description=help_text))
    return parser


def run_subcommand(parser: argparse.ArgumentParser, commands: Subcommands, metavar: str,
                   argv: list[str] | None = None) -> int:
    """Parse argv, run the chosen subcommand and print its results as one JSON line, the last printed."""
    args = parser.parse_args(argv)
    print(json.dumps(commands[getattr(args, metavar.lower())][0](args)))
    return 0
