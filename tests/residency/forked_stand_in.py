"""A stand-in worker module for fork-server tests: no PyTorch. `warm_up` holds BALLAST_MB of
touched memory (pages a forked child shares with the fork server until it writes them);
`keep(model)` keeps the name (`"fail"` raises) for the children forked after; `main(argv)` answers
200 to anything on the Unix socket after `--socket`, the names kept in its `x-kept` header, until
killed."""

from __future__ import annotations

import http.server
import os
import socketserver
import sys

_ballast: bytearray | None = None
_kept: list[str] = []


def warm_up() -> None:
    global _ballast
    _ballast = bytearray(os.urandom(1 << 20)) * int(os.environ.get("BALLAST_MB", "0"))


def keep(model: str) -> list[str]:
    if model == "fail":
        raise ValueError("no tokenizer here")
    _kept.append(model)
    return list(_kept)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("x-kept", ",".join(_kept))
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Server(socketserver.UnixStreamServer):
    def get_request(self):  # type: ignore[no-untyped-def]
        request, _ = super().get_request()
        return request, ("", 0)


def main(argv: list[str]) -> int:
    _Server(argv[argv.index("--socket") + 1], _Handler).serve_forever()
    return 0


if __name__ == "__main__":  # spawned, as a worker is where there is no fork server
    sys.exit(main(sys.argv[1:]))
