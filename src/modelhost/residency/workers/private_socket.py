"""What only this user may reach: a directory (0700) for a process's sockets, and a listening
Unix socket in it (0600). Workers, spares and the fork server each serve from one."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

DIRECTORY_PREFIX = "modelhost-worker-"


def private_directory(prefix: str = DIRECTORY_PREFIX) -> Path:
    """A new temporary directory only this user can enter."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(directory, 0o700)
    return directory


def bind_private_socket(path: str) -> socket.socket:
    """A listening Unix socket at `path` that only this user can connect to (0600).

    `path` appears only once the socket listens: it is bound under another name, then linked
    to `path` (which fails where `path` exists, as binding it would). Callers wait for the path
    to exist and then connect; a socket bound but not yet listening would refuse them (a window
    a busy machine widens)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    binding = f"{path}~"
    try:
        previous = os.umask(0o177)
        try:
            sock.bind(binding)
        finally:
            os.umask(previous)
        try:
            os.chmod(binding, 0o600)
            sock.listen(128)
            sock.set_inheritable(False)
            os.link(binding, path)
        finally:
            os.unlink(binding)
    except BaseException:
        sock.close()
        raise
    return sock
