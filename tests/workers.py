"""The suite on several cores: `pytest -n N` (pytest-xdist), as `make test` runs it (its WORKERS; docs/benchmarks.md,
"make test on several cores").

A plugin that tests/conftest.py registers where pytest-xdist is installed:
- `-n auto` picks auto_workers(): no more workers than cores, nor than the memory holds at WORKER_GIB each (a worker
  may run a vLLM engine and two torchrun ranks at once), nor than MAX_WORKERS;
- the tests go to the workers in groups, whatever `--dist` asked (but `each`, `loadscope`, `loadfile`,
  `worksteal`): a test marked `xdist_group(name)` goes with the others of that name, every other test with its
  file's, so a module fixture (a vLLM engine, a run that several tests read) is built once, on one worker.
  tests/test_e2e.py and tests/test_pipeline_rl.py put each fixture's tests in a group of their own, so that their
  runs spread over the workers instead of lining up on one;
- the longest groups go first, by the seconds tests/durations.json holds for their tests (`--store-durations`
  writes it from a run; a test it does not know counts as UNKNOWN_SLOW_S if marked slow, UNKNOWN_FAST_S if not): a
  worker takes the next group as it runs out, so the short groups at the end even out the workers' finishing times.

pytest-xdist's own `--dist loadgroup` names a test's group in its node id, which pytest 9 no longer lets a plugin
change (`item._nodeid` is not read any more: every test was scheduled alone). So each worker writes the groups of
the tests it collected to a file of the session (GROUPS_DIR), and the controller's GroupScheduling reads them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

WORKER_GIB = 6  # measured: a test running vLLM and 2 torchrun ranks on the tiny model peaks at 3-6 GiB
MAX_WORKERS = 4  # more would only start more vLLM engines and ranks at once, each with threads for every core
GROUPS_DIR = "SCALERL_TEST_GROUPS_DIR"  # set by the controller, inherited by its workers
GROUPED = ("load", "loadgroup")  # the --dist modes this plugin schedules
DURATIONS = Path(__file__).with_name("durations.json")  # seconds per test id: setup, call and teardown together
UNKNOWN_SLOW_S = 30.0  # a slow test tests/durations.json does not know (the suite's slow tests: 5-210 s)
UNKNOWN_FAST_S = 0.5


def add_options(parser: pytest.Parser) -> None:
    """Called by tests/conftest.py's pytest_addoption (a plugin registered later cannot add options)."""
    parser.addoption("--store-durations", nargs="?", const=str(DURATIONS), default=None, metavar="PATH",
                     help="write tests/durations.json (or PATH) from this run: each test's setup, call and teardown "
                          "seconds, merged with the file's other tests. It orders the groups on workers, longest first")


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    """tests/durations.json, or nothing where it is missing or unreadable (the order is then by slow markers)."""
    try:
        durations = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return durations if isinstance(durations, dict) else {}


def group_seconds(items: list[pytest.Item], durations: dict[str, float]) -> dict[str, float]:
    """Each group's expected seconds: its tests' stored durations, UNKNOWN_SLOW_S or UNKNOWN_FAST_S where unknown."""
    seconds: dict[str, float] = defaultdict(float)
    for item in items:
        unknown = UNKNOWN_SLOW_S if item.get_closest_marker("slow") else UNKNOWN_FAST_S
        seconds[group_of(item)] += float(durations.get(item.nodeid, unknown))
    return seconds


def available_gib() -> float:
    """MemAvailable of /proc/meminfo in GiB (a machine without it: as if memory were no limit)."""
    try:
        for line in open("/proc/meminfo", encoding="ascii"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def auto_workers() -> int:
    """`-n auto`: min(cores this process may use, available memory / WORKER_GIB, MAX_WORKERS), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, int(min(cores, available_gib() / WORKER_GIB, MAX_WORKERS)))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():  # pytest-xdist's own override, kept
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return auto_workers()


def is_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker (`-n N`): the controller reports, each worker runs its share of the tests."""
    return hasattr(config, "workerinput")


def _grouping(config: pytest.Config) -> bool:
    """The controller of a run this plugin schedules."""
    return not is_worker(config) and bool(getattr(config.option, "tx", None)) and config.option.dist in GROUPED


def pytest_configure(config: pytest.Config) -> None:
    if _grouping(config):
        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="scalerl-test-groups-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _grouping(config) and os.environ.get(GROUPS_DIR):
        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


def pytest_configure_node(node) -> None:
    """Tell each worker to group (it parses the command line again, where `-n 2` alone says nothing of groups)."""
    node.workerinput["scalerl_groups"] = _grouping(node.config)


def group_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return item.nodeid.split("::", 1)[0]
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: the longest groups first, each group's tests in the order of the file (a fixture's last test
    may end it); then every test's group written for the controller (atomically: the controller reads it once
    every worker has collected)."""
    if not getattr(config, "workerinput", {}).get("scalerl_groups"):
        return
    seconds = group_seconds(items, read_durations())
    items.sort(key=lambda item: -seconds[group_of(item)])  # stable: the collection's order within a group
    directory = Path(os.environ[GROUPS_DIR])
    tmp = directory / f".{config.workerinput['workerid']}.json"
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    tmp.rename(directory / f"{config.workerinput['workerid']}.json")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> object | None:
    if not _grouping(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """pytest-xdist's scheduling by scope, a test's scope its group (the workers' files), in the order the
        workers collected the groups (pytest-xdist would sort them by their number of tests)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                found = sorted(Path(os.environ[GROUPS_DIR]).glob("*.json"))
                self.groups = json.loads(found[0].read_text()) if found else {}
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


class DurationRecorder:
    """`--store-durations`: on the controller (or a run without workers), every test's seconds from the reports,
    written into tests/durations.json at the end, merged with the tests this run did not run."""

    def __init__(self, path: Path = DURATIONS):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        merged = read_durations(self.path) | {test: round(s, 1) for test, s in self.seconds.items()}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")
        tmp.rename(self.path)


def register_recorder(config: pytest.Config) -> None:
    """Called by tests/conftest.py's pytest_configure."""
    path = config.getoption("store_durations", None)
    if path and not is_worker(config):
        config.pluginmanager.register(DurationRecorder(Path(path)), "scalerl-durations")
