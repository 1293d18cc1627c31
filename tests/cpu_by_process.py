"""The CPU time of every process a command starts: `python tests/cpu_by_process.py -- CMD ...`, e.g.

    python tests/cpu_by_process.py -- torchrun --standalone --nproc_per_node 2 train.py --max-steps 3 ...

Every SAMPLE_S it walks the command's process tree in /proc (each task's children) and reads each process's user and
system time (/proc/PID/stat) and its minor page faults; at the end it prints each process with its last reading, its
first and last time seen, and its command line, then the total. A process is read while it lives: what it did after
the last reading (at most SAMPLE_S), and a process that lived less than SAMPLE_S, is missed. A test-suite tool (where
`make test`'s CPU-seconds go, docs/benchmarks.md): nothing in the project runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SAMPLE_S = 0.2
TICKS = os.sysconf("SC_CLK_TCK")


def tree(root: int) -> list[int]:
    """`root` and every process under it (through each thread's children: a child may be any thread's)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    todo += [int(child) for child in children.read().split()]
        except OSError:  # it ended meanwhile
            pass
    return found


def reading(pid: int) -> tuple[float, float, int, str] | None:
    """(user seconds, system seconds, minor faults, command line) of `pid`, or None if it has ended."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        with open(f"/proc/{pid}/cmdline") as cmdline:
            command = cmdline.read().replace("\0", " ").strip()
    except OSError:
        return None
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS, int(fields[7]), command


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit("usage: python tests/cpu_by_process.py -- CMD ...")
    command = argv[argv.index("--") + 1:]
    start = time.monotonic()
    proc = subprocess.Popen(command)
    seen: dict[int, tuple[float, float, int, str, float, float]] = {}
    while proc.poll() is None:
        now = time.monotonic() - start
        for pid in tree(proc.pid):
            read = reading(pid)
            if read is not None:
                first, command = (seen[pid][4], read[3] or seen[pid][3]) if pid in seen else (now, read[3])
                seen[pid] = (*read[:3], command, first, now)  # (an ended process, not yet reaped, has no command)
        time.sleep(SAMPLE_S)
    wall = time.monotonic() - start
    print(f"{'pid':>7} {'user s':>7} {'sys s':>6} {'faults':>8} {'seen, s':>13}  command", file=sys.stderr)
    for pid, (user, system, faults, cmd, first, last) in sorted(seen.items()):
        print(f"{pid:7d} {user:7.1f} {system:6.1f} {faults / 1e3:7.0f}k {first:6.1f}-{last:6.1f}  {cmd[:100]}",
              file=sys.stderr)
    total = sum(user + system for user, system, *_ in seen.values())
    print(f"{len(seen)} processes, {total:.1f} CPU-seconds, {wall:.1f} s, exit {proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
