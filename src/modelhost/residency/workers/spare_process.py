"""A spare worker: a Python process that has already imported what a worker needs, waiting for
the command line that makes it one.

    python -m modelhost.residency.workers.spare_process --module MODULE --ready PATH [--nice N]

`SpareWorkers` (spare_pool.py) starts it in a session of its own with a pipe on its stdin. A
thread calls MODULE's `warm_up()` (PyTorch, the native kernels, the tokenizer machinery), then
creates PATH. The warm-up runs at a low priority, to yield the CPU to a model answering beside
it: before anything else the process lowers its session's autogroup to nice N (default 10;
where Linux groups sessions for the scheduler, a thread's nice counts only inside its own
session; see autogroup.py), and the warm-up thread runs at nice N (where it does not). `--nice
0` warms up at the usual priority: the pool asks for it when switches come faster than a
low-priority warm-up finishes. The main thread reads one line from stdin, a JSON list of
arguments, puts its autogroup back to nice 0 (a worker started afresh runs at the usual
priority, and so does this one), waits for the warm-up, and becomes the worker:
`sys.exit(MODULE.main(arguments))`, in the main thread (the worker's server installs signal
handlers). The end of stdin before a line (the parent gone, or it stopping the spare) ends the
process at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from modelhost.residency.workers.autogroup import AutogroupNice

# Low, not idle: on a machine kept busy, a warm-up at nice 19 would hardly ever finish.
WARM_UP_NICE = 10  # the warm-up thread's, and the whole session's while a spare (autogroup.py)
TAKEN_FILE = "spare-taken"  # beside the ready file, once the worker's arguments have arrived


def warm(module: ModuleType, ready: Path, nice: int = WARM_UP_NICE) -> None:
    if sys.platform == "linux" and nice:  # a thread's own id is a process id only to Linux's nice
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    warm_up = getattr(module, "warm_up", None)
    try:
        if warm_up is not None:
            warm_up()
        ready.touch()
    except BaseException as exc:  # a spare that cannot warm up must not wait to be handed a model
        print(f"modelhost-spare: the warm-up failed: {exc!r}", file=sys.stderr)
        os._exit(1)


def read_command() -> list[str] | None:
    """The worker's arguments from the parent, or None when stdin ends first (or is garbled)."""
    line = sys.stdin.buffer.readline()
    try:
        arguments = json.loads(line)
    except ValueError:
        return None
    if not isinstance(arguments, list) or not all(isinstance(a, str) for a in arguments):
        return None
    return arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="modelhost-spare")
    parser.add_argument("--module", required=True, help="the worker's module (its main, warm_up)")
    parser.add_argument("--ready", required=True, help="a file created once warm")
    parser.add_argument("--nice", type=int, default=WARM_UP_NICE, choices=range(20),
                        help="the warm-up's priority (0: as urgent as a model's work)")  # fmt: skip
    args = parser.parse_args(argv)
    autogroup = AutogroupNice()
    if args.nice:
        autogroup.set(args.nice)  # first: importing the worker's module is warm-up too
    module = importlib.import_module(args.module)
    warming = threading.Thread(
        target=warm, args=(module, Path(args.ready), args.nice), name="spare-warm-up", daemon=True
    )
    warming.start()

    def settle() -> None:
        if args.nice:
            autogroup.set(0)  # the usual priority, from the load on
        warming.join()

    return become_worker(module, Path(args.ready), settle)


def become_worker(
    module: ModuleType, ready: Path, settle: Callable[[], None] = lambda: None
) -> int:
    """Wait for the worker's arguments on stdin and run MODULE's main with them (`settle` first,
    once they have come); a spare forked warm (fork_server.py) comes here at once."""
    arguments = read_command()
    if arguments is None:
        # Nobody will use this process (not even its warm-up): and where the serving process
        # was killed, nobody else removes its directory.
        shutil.rmtree(ready.parent, ignore_errors=True)
        os._exit(0)
    ready.with_name(TAKEN_FILE).touch()  # from here on, failing is the worker's
    settle()
    with open(os.devnull, "rb") as nothing:  # as a worker started afresh has it
        os.dup2(nothing.fileno(), 0)
    result: int = module.main(arguments)
    return result


if __name__ == "__main__":
    sys.exit(main())
