"""The HTTP layer's CPU a streamed token, against what any event loop pays to send one.

    .venv/bin/python benchmarks/http_layer.py [--frames 2000] [--interval-ms 2] [--repeats 5]
                                              [--out FILE]

Two servers stream one frame every `--interval-ms` to a reader in a child process (a raw
socket, so the reader takes little of the CPU), and the CPU of each server's event-loop thread
is read from its thread clock:

- floor: a bare uvloop server that writes one ~200-byte chunk each tick. A wake-up and a socket
  write a frame: what a server whose loop sleeps between tokens cannot avoid.
- modelhost: the real app (`build_app`, every middleware) streaming OpenAI chat over the test
  suite's scripted engine, which also makes one token each tick of a timer on the loop.

Their difference is what modelhost's HTTP layer costs a token beyond the floor, with neither the
engine's kernels nor their noise in the way (`serving.py` measures the layer under the real
engine). The two alternate in each repeat. Prints a table and writes JSON (default
benchmarks/results/http-layer-<time>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from live_server import LiveServer  # noqa: E402
from scripted_engine import ScriptedEngine, scripted_model  # noqa: E402
from serving import thread_cpu_s, write_result  # noqa: E402  (beside this script)

from modelhost.assembly import build_app  # noqa: E402
from modelhost.server.settings import ServeSettings  # noqa: E402

FRAME = (
    b'data: {"id":"chatcmpl-00000000000000000000000000000000","object":"chat.completion.chunk",'
    b'"created":1790000000,"model":"scripted-model","choices":[{"index":0,'
    b'"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n'
)
CHUNK = b"%x\r\n%s\r\n" % (len(FRAME), FRAME)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def read_stream(port: int, request: bytes) -> int:
    """Send `request` and read until the server closes: the bytes received."""
    received = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        while data := sock.recv(65536):
            received += len(data)
    return received


def chat_request(frames: int) -> bytes:
    body = json.dumps(
        {
            "model": "scripted-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": frames,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class FloorServer:
    """Per connection: the response head, then `frames` chunks one `interval_s` apart."""

    def __init__(self, frames: int, interval_s: float) -> None:
        self.frames = frames
        self.interval_s = interval_s
        self.port = 0
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[None] | None = None
        self.thread = threading.Thread(target=uvloop.run, args=(self._serve(),), daemon=True)

    def start(self) -> FloorServer:
        self.thread.start()
        self._started.wait(30)
        return self

    def stop(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self.thread.join(30)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        server = await asyncio.start_server(self._stream, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        async with server:
            await self._stop

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD)
        for _ in range(self.frames):
            await asyncio.sleep(self.interval_s)
            writer.write(CHUNK)
        writer.write(b"0\r\n\r\n")
        writer.close()


def loop_cpu_us(thread: threading.Thread, run: Callable[[], object], frames: int) -> float:
    """CPU microseconds of `thread` a frame while `run()` streams `frames` frames."""
    before = thread_cpu_s(thread)
    run()
    return (thread_cpu_s(thread) - before) / frames * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    interval_s = args.interval_ms / 1000

    floor = FloorServer(args.frames, interval_s).start()
    engine = ScriptedEngine([" word"] * (args.frames + 1), step_s=interval_s)
    app = build_app(engine, scripted_model(context_length=1 << 20), ServeSettings())
    served = LiveServer(app).start()
    reader = multiprocessing.get_context("spawn").Pool(1)
    request = chat_request(args.frames)
    try:
        reader.apply(read_stream, (served.port, chat_request(8)))  # warm-up
        floor_us, modelhost_us = [], []
        for _ in range(args.repeats):
            floor_us.append(
                loop_cpu_us(
                    floor.thread,
                    lambda: reader.apply(read_stream, (floor.port, b"GET / HTTP/1.1\r\n\r\n")),
                    args.frames,
                )
            )
            modelhost_us.append(
                loop_cpu_us(
                    served.thread,
                    lambda: reader.apply(read_stream, (served.port, request)),
                    args.frames,
                )
            )
    finally:
        reader.terminate()
        served.stop()
        floor.stop()

    result = {
        "frames": args.frames,
        "interval_ms": args.interval_ms,
        "floor_us_per_frame": floor_us,
        "modelhost_us_per_frame": modelhost_us,
        "floor_median_us": statistics.median(floor_us),
        "modelhost_median_us": statistics.median(modelhost_us),
    }
    result["modelhost_over_floor_us"] = result["modelhost_median_us"] - result["floor_median_us"]
    print(f"{'loop CPU a frame (us)':<26} {'median':>8}   runs")
    for name, runs in (("floor", floor_us), ("modelhost", modelhost_us)):
        listed = " ".join(f"{x:.0f}" for x in runs)
        print(f"{name:<26} {statistics.median(runs):>8.1f}   {listed}")
    print(f"{'modelhost over the floor':<26} {result['modelhost_over_floor_us']:>8.1f}")
    write_result(result, args.out, "http-layer")


if __name__ == "__main__":
    main()
