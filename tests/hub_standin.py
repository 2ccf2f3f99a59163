"""A stand-in for the Hugging Face hub on 127.0.0.1, serving what `huggingface_hub` calls for
a download: `GET /api/models/{repo}[/revision/{rev}]` (the file list with sizes, git blob ids
and LFS sha256s) and `HEAD`/`GET /{repo}/resolve/{rev}/{file}` (X-Repo-Commit, ETag and
X-Linked-Etag, X-Linked-Size, ranges). Errors carry the hub's `X-Error-Code` (RepoNotFound,
GatedRepo, EntryNotFound). A test can gate a repo, advertise a wrong checksum for a file, have a
file's first download cut short, or stall it until released; every request is logged with the
bytes sent."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class StandInRepo:
    files: dict[str, bytes]
    gated: bool = False
    wrong_sha256: set[str] = field(default_factory=set)  # advertised, not what is served
    cut_once: dict[str, int] = field(default_factory=dict)  # name -> bytes its first GET sends
    # name -> bytes a whole GET sends before it waits for the hub's `release`
    stall_at: dict[str, int] = field(default_factory=dict)


@dataclass
class Fetch:
    method: str
    repo: str
    file: str
    range: str | None
    sent: int  # body bytes


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class StandInHub:
    def __init__(self, token: str = "hf_test_token") -> None:
        self.repos: dict[str, StandInRepo] = {}
        self.fetches: list[Fetch] = []
        self.token = token
        self.release = threading.Event()  # lets a stalled download go on
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes | Path], **options: object) -> StandInRepo:
        contents = {
            name: (data.read_bytes() if isinstance(data, Path) else data)
            for name, data in files.items()
        }
        repo = StandInRepo(contents, **options)  # type: ignore[arg-type]
        self.repos[repo_id] = repo
        return repo

    def sent(self, repo_id: str, name: str) -> int:
        """Body bytes of `name` sent so far (GETs)."""
        return sum(f.sent for f in self.fetches if f.repo == repo_id and f.file == name)

    def sha256(self, repo_id: str, name: str) -> str:
        return hashlib.sha256(self.repos[repo_id].files[name]).hexdigest()

    def start(self) -> StandInHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def _sibling(name: str, data: bytes, repo: StandInRepo) -> dict[str, object]:
    row: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
    if name.endswith(LFS_SUFFIXES):
        sha = hashlib.sha256(data).hexdigest()
        if name in repo.wrong_sha256:
            sha = hashlib.sha256(data + b"tampered").hexdigest()
        row["lfs"] = {"size": len(data), "sha256": sha, "pointerSize": 134}
    return row


def _handler(hub: StandInHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _error(self, status: int, code: str, message: str, body: bool) -> None:
            payload = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
            if info:
                self._model_info(info.group(1), body)
                return
            resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not resolve:
                self._error(404, "EntryNotFound", "no such route", body)
                return
            self._file(resolve.group(1), resolve.group(3), body)

        def _model_info(self, repo_id: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", body)
                return
            payload = json.dumps(
                {
                    "id": repo_id,
                    "sha": COMMIT,
                    "private": False,
                    "gated": "manual" if repo.gated else False,
                    "siblings": [_sibling(n, d, repo) for n, d in repo.files.items()],
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _file(self, repo_id: str, name: str, body: bool) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", body)
                return
            if repo.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "GatedRepo", "Access to this model is restricted", body)
                return
            data = repo.files.get(name)
            if data is None:
                self._error(404, "EntryNotFound", "Entry not found", body)
                return
            sibling = _sibling(name, data, repo)
            lfs = sibling.get("lfs")
            etag = lfs["sha256"] if isinstance(lfs, dict) else sibling["blobId"]
            wanted = self.headers.get("Range")
            start, end = 0, len(data)
            match = _RANGE.fullmatch(wanted or "")
            status = 200
            if match:
                start = int(match.group(1))
                end = min(len(data), int(match.group(2)) + 1 if match.group(2) else len(data))
                status = 206
            part = data[start:end]
            self.send_response(status)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{etag}"')
            if lfs:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(part)))
            self.end_headers()
            if not body:
                hub.fetches.append(Fetch("HEAD", repo_id, name, wanted, 0))
                return
            if name in repo.cut_once and status == 200:
                half = part[: repo.cut_once.pop(name)]
                self.wfile.write(half)
                self.wfile.flush()
                hub.fetches.append(Fetch("GET", repo_id, name, wanted, len(half)))
                self.close_connection = True
                self.connection.shutdown(2)  # the connection drops mid-body
                return
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it had enough
                if name in repo.stall_at and status == 200:
                    head = repo.stall_at.pop(name)
                    self.wfile.write(part[:head])
                    self.wfile.flush()
                    hub.release.wait(timeout=60)
                    part = part[head:]
                self.wfile.write(part)
            hub.fetches.append(Fetch("GET", repo_id, name, wanted, len(part)))

    return Handler
