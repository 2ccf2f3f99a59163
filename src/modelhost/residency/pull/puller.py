"""A pull in two steps, each reporting its progress as Ollama's pull statuses:

- `prepare`: the repo's file list, the files the reference means (plan.py), the checks made
  before any weight is fetched (checks.py). Every refusal is a PullError with its status.
- `fetch`: each file through `huggingface_hub.hf_hub_download` into the shared cache (the hub
  client retries a cut connection from where it stopped, with a range request, and writes a
  file under its name only once complete), then each file's checksum against the hub's (an
  LFS file's sha256, a small file's git blob id): a mismatch removes the file and fails. While
  the files are written and checked, the repo's marker keeps the registry from listing them;
  at the end the hub folder is touched, so a running server's next lookup rescans.

Cancelling (`cancel` set, or an interrupt) stops the download at its next chunk; the hub
client removes its temporary file. A cache that cannot be written is a 507 when its disk is full,
else a 503 naming the folder: never an unexplained failure.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download
from huggingface_hub.utils import tqdm as hub_tqdm

from modelhost.residency.pull import checks
from modelhost.residency.pull.hub_access import hub_endpoint, hub_errors, repo_info
from modelhost.residency.pull.marker import pulling
from modelhost.residency.pull.plan import HubFile, PullPlan, hub_files, plan_files
from modelhost.residency.pull.reference import PullError, parse_reference
from modelhost.residency.registry import hf_hub_dir

_READ = 1 << 20


@dataclass(frozen=True, slots=True)
class PullProgress:
    """One of Ollama's pull statuses (`pulling manifest`, `pulling <digest>`, `verifying sha256
    digest`, `writing manifest`, `success`), with a file's bytes while it downloads."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None
    file: str | None = None  # the file's path in the repo (for people; not in Ollama's JSON)

    def as_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"status": self.status}
        if self.digest is not None:
            row.update(digest=self.digest, total=self.total, completed=self.completed)
        return row


Report = Callable[[PullProgress], None]


class PullCancelled(Exception):
    """The pull was cancelled (its client left)."""


def _quiet(progress: PullProgress) -> None:
    pass


def prepare(name: object, report: Report = _quiet) -> PullPlan:
    """The plan of a pull of `name`, checked: servable, and room for it on disk."""
    reference = parse_reference(name)
    report(PullProgress("pulling manifest"))
    info = repo_info(reference)
    plan = plan_files(reference, str(info.sha or reference.revision), hub_files(info.siblings))
    reason = checks.refusal(plan)
    if reason is not None:
        shown = plan.files[0].name if plan.kind == "gguf" else plan.reference.repo_id
        raise PullError(400, f"{shown} cannot be served: {reason}")
    checks.check_disk(plan, hf_hub_dir())
    return plan


def fetch(
    plan: PullPlan,
    report: Report = _quiet,
    *,
    cancel: threading.Event | None = None,
    show_bars: bool = False,
) -> Path:
    """Downloads and verifies the plan's files; the path the registry lists the model at."""
    cache_dir = hf_hub_dir()
    repo_dir = cache_dir / f"models--{plan.reference.repo_id.replace('/', '--')}"
    stop = cancel or threading.Event()
    paths: dict[str, Path] = {}
    try:
        with pulling(repo_dir, (f.name for f in plan.files)):
            for hub_file in plan.files:
                if stop.is_set():
                    raise PullCancelled(f"the pull of {plan.reference} was cancelled")
                paths[hub_file.name] = _download(plan, hub_file, cache_dir, report, stop, show_bars)
            report(PullProgress("verifying sha256 digest"))
            for hub_file in plan.files:
                _verify(plan, hub_file, paths[hub_file.name])
            report(PullProgress("writing manifest"))
        os.utime(cache_dir)  # a running server's registry rescans at its next unknown id
    except OSError as error:
        raise _cache_error(plan, cache_dir, error) from error
    pulled = paths[plan.files[0].name]
    return pulled if plan.kind == "gguf" else pulled.parent


def _cache_error(plan: PullPlan, cache_dir: Path, error: OSError) -> PullError:
    """A write into the cache that failed, as a pull's error: 507 for a full disk, else 503."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    return PullError(
        507 if full else 503,
        f"the pull of {plan.reference} could not write the Hugging Face cache at {cache_dir} "
        f"({error.strerror or error}): "
        + ("free some disk" if full else "set HF_HUB_CACHE or HF_HOME to a writable folder"),
    )


def _download(
    plan: PullPlan,
    hub_file: HubFile,
    cache_dir: Path,
    report: Report,
    stop: threading.Event,
    show_bars: bool,
) -> Path:
    def bytes_done(done: int) -> None:
        if stop.is_set():
            raise PullCancelled(f"the pull of {plan.reference} was cancelled")
        status = f"pulling {digest12}"
        report(PullProgress(status, hub_file.digest, hub_file.size, done, hub_file.name))

    digest12 = hub_file.digest.partition(":")[2][:12]
    bytes_done(0)
    with hub_errors(plan.reference):
        path = hf_hub_download(
            plan.reference.repo_id,
            hub_file.name,
            revision=plan.reference.revision,
            cache_dir=cache_dir,
            endpoint=hub_endpoint(),
            tqdm_class=_reporting_bar(bytes_done, show_bars, hub_file.name),
        )
    bytes_done(hub_file.size)
    return Path(path)


def _reporting_bar(bytes_done: Callable[[int], None], show: bool, label: str) -> type[hub_tqdm]:
    """huggingface_hub's progress bar (drawn on a terminal when `show`, labelled with the
    file's name rather than its URL) that also reports each chunk's bytes; raising from it
    stops the download."""

    class ReportingBar(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if not show:
                kwargs["disable"] = True
            kwargs["desc"] = label
            self.done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            bytes_done(self.done)
            return super().update(n)

    return ReportingBar


def _verify(plan: PullPlan, hub_file: HubFile, path: Path) -> None:
    """The file's checksum against the hub's; on a mismatch the file goes (its name in the
    snapshot and its blob) and the pull fails."""
    if hub_file.sha256:
        expected, actual = hub_file.sha256, _digest(path, hashlib.sha256())
    elif hub_file.blob_id:  # a small file in git: its blob id is sha1("blob <size>\0" + data)
        hasher = hashlib.sha1(usedforsecurity=False)
        hasher.update(b"blob %d\0" % path.stat().st_size)
        expected, actual = hub_file.blob_id, _digest(path, hasher)
    else:
        return
    if actual == expected:
        return
    blob = path.resolve()
    path.unlink(missing_ok=True)
    blob.unlink(missing_ok=True)
    raise PullError(
        502,
        f"{hub_file.name} of {plan.reference.repo_id} does not match the hub's checksum "
        f"(expected {expected}, got {actual}); the file was removed: pull again",
    )


def _digest(path: Path, hasher: Any) -> str:
    with path.open("rb") as f:
        while chunk := f.read(_READ):
            hasher.update(chunk)
    return str(hasher.hexdigest())
