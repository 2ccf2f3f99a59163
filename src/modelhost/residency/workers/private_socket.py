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
    """A listening Unix socket at `path` that only this user can connect to (0600)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.set_inheritable(False)
    return sock
