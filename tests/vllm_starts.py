"""Count the vLLM engines a command starts, per test: `python tests/vllm_starts.py [--log FILE] -- CMD ...`, e.g.

    python tests/vllm_starts.py -- python -m pytest tests/test_e2e.py -q

vLLM reads a logging config from VLLM_LOGGING_CONFIG_PATH in every process that imports it; every process the
command starts inherits it (torchrun's ranks, the generator's replicas, a test's subprocesses). The config this
writes keeps vLLM's console logging as it was (its level from VLLM_LOGGING_LEVEL, as a replica sets it) and also
appends each engine's first line, "Initializing a V1 LLM engine", to a file, with the pid and the test that started
the process (PYTEST_CURRENT_TEST, which pytest sets in its environment and a subprocess inherits: a module fixture's
start is named after the first test that asked for it, "(setup)"). At the end it prints the starts per test and per
file. A test-suite tool: nothing in the project reads VLLM_LOGGING_CONFIG_PATH.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE_START = "Initializing a V1 LLM engine"  # vllm/v1/engine/core.py, once per engine core


class EngineStarts(logging.Filter):
    """Passes vLLM's engine-start record only, naming the test this process was started in."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.test = os.environ.get("PYTEST_CURRENT_TEST", "-")
        return isinstance(record.msg, str) and record.msg.startswith(ENGINE_START)


def console() -> logging.Handler:
    """A console handler like vLLM's default one (its stream and level from VLLM_LOGGING_STREAM and
    VLLM_LOGGING_LEVEL), built when vLLM configures its logging, so a process logs to its console as it did."""
    from vllm.logging_utils import NewLineFormatter

    stream = {"ext://sys.stdout": sys.stdout, "ext://sys.stderr": sys.stderr}[
        os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout")]
    level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(stream)
    handler.setLevel(level)
    handler.setFormatter(NewLineFormatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
                                          "%m-%d %H:%M:%S", log_level=level))
    return handler


def logging_config(starts_file: Path) -> dict:
    """The dictConfig vLLM loads: its console handler, and the engine starts to `starts_file`."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"engine_start": {"()": "vllm_starts.EngineStarts"}},
        "formatters": {"start": {"format": "%(created).3f\t%(process)d\t%(test)s"}},
        "handlers": {
            "console": {"()": "vllm_starts.console"},
            "starts": {"class": "logging.FileHandler", "filename": str(starts_file), "mode": "a",
                       "level": "INFO", "filters": ["engine_start"], "formatter": "start"},
        },
        # DEBUG at the logger: the console handler keeps its own level, the start record (INFO) always passes
        "loggers": {"vllm": {"handlers": ["console", "starts"], "level": "DEBUG", "propagate": False}},
    }


def tally(starts_file: Path) -> dict:
    """{"total": n, "files": {file: n}, "tests": {test id: n}} from the starts file's lines."""
    tests: collections.Counter = collections.Counter()
    for line in starts_file.read_text().splitlines() if starts_file.exists() else []:
        _, _, test = line.split("\t", 2)
        tests[test.rsplit(" (", 1)[0]] += 1
    files = collections.Counter()
    for test, n in tests.items():
        files[test.split("::", 1)[0]] += n
    return {"total": sum(tests.values()), "files": dict(sorted(files.items())), "tests": dict(sorted(tests.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", type=Path, help="keep the starts here (one line a start: time, pid, test)")
    parser.add_argument("--json", type=Path, help="write the tally here too")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    with tempfile.TemporaryDirectory(prefix="vllm-starts-") as tmp:
        starts = args.log or Path(tmp) / "starts.tsv"
        starts.unlink(missing_ok=True)
        config = Path(tmp) / "vllm-logging.json"
        config.write_text(json.dumps(logging_config(starts.resolve())))
        here = str(Path(__file__).resolve().parent)
        env = {**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(config),
               "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        rc = subprocess.run(command, env=env).returncode
        result = tally(starts)
    print(f"\nvLLM starts: {result['total']}")
    for name, n in result["files"].items():
        print(f"  {n:3d}  {name}")
    for name, n in result["tests"].items():
        print(f"      {n:3d}  {name}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
