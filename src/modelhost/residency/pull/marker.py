"""A pull's marker in its repo's cache folder: the files it is still writing or checking, so
that a scan does not list a model whose bytes are not yet verified.

`models--org--name/.modelhost-pull-<pid>-<n>.json` holds `{"pid": ..., "files": [...]}`. A marker
whose process is gone (a pull killed outright) is ignored and removed by the next pull of the
repo: what that pull left is no model (the hub client writes a file under its name only once
complete, config.json is fetched last), and a verified pull rewrites what it needs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

PREFIX = ".modelhost-pull-"
_NUMBERS = itertools.count()  # two pulls of one process each have their own marker


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def files_being_pulled(repo_dir: Path) -> set[str]:
    """The file names (relative to a snapshot) that live pulls of this repo have not finished."""
    pulling: set[str] = set()
    for marker in repo_dir.glob(f"{PREFIX}*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            row = json.loads(marker.read_text())
            if _alive(int(row["pid"])):
                pulling.update(str(name) for name in row["files"])
    return pulling


@contextlib.contextmanager
def pulling(repo_dir: Path, files: Iterable[str]) -> Iterator[None]:
    """Marks `files` as being pulled into `repo_dir` until the block ends (either way)."""
    repo_dir.mkdir(parents=True, exist_ok=True)
    for stale in repo_dir.glob(f"{PREFIX}*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            if not _alive(int(json.loads(stale.read_text())["pid"])):
                stale.unlink()
    marker = repo_dir / f"{PREFIX}{os.getpid()}-{next(_NUMBERS)}.json"
    marker.write_text(json.dumps({"pid": os.getpid(), "files": sorted(files)}))
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)
