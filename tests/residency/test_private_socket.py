"""A private socket's path: it appears only once the socket listens (whoever waits for the path
then connects at once), and only its user may connect."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest

from modelhost.residency.workers import private_socket
from modelhost.residency.workers.private_socket import bind_private_socket


def test_a_private_sockets_path_appears_only_once_it_listens(tmp_path, monkeypatch):
    path = tmp_path / "server.sock"
    existed_before_listening: list[bool] = []

    class Watched(socket.socket):
        def listen(self, backlog: int = 0, /) -> None:
            existed_before_listening.append(path.exists())
            super().listen(backlog)

    monkeypatch.setattr(private_socket.socket, "socket", Watched)
    listener = bind_private_socket(str(path))
    monkeypatch.undo()
    with listener, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        assert existed_before_listening == [False]
        client.connect(str(path))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in tmp_path.iterdir()) == ["server.sock"]


def test_a_private_socket_refuses_a_path_already_listened_on(tmp_path: Path):
    path = str(tmp_path / "server.sock")
    with bind_private_socket(path), pytest.raises(OSError):
        bind_private_socket(path)
