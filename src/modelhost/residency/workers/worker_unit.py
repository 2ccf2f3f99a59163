"""A unit whose model lives in a worker process: its process, its bytes, and the channel to it.

The server proxies requests to the worker's socket through `client()` (`server/front/worker_proxy`);
the unit itself only asks the worker for its figures (`get_json`) and, in a forced shutdown, to
end its requests (`interrupt`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from modelhost.residency.workers.memory_reading import LastReading
from modelhost.residency.workers.supervisor import WorkerProcess
from modelhost.residency.workers.worker_transport import WorkerClient

DRAIN_ANSWER_S = 2.0  # a forced drain answers at once; a worker that does not is killed
GIVE_BACK_ANSWER_S = 10.0  # an idle engine gives back its pool between two steps


class WorkerUnit:
    resumed = False
    hands_off = True  # a stream's client socket may be passed to the worker (same machine)
    node: str | None = None  # in a cluster: the node the worker runs on

    def __init__(self, model_id: str, weights_bytes: int, worker: WorkerProcess) -> None:
        self._model_id = model_id
        self.weights_bytes = weights_bytes
        self.worker = worker
        self.load_ms = 0.0
        self._measured: int | None = None
        self._reading = LastReading(lambda: self.worker.memory_bytes())
        self._closed = False
        # Set once the server's shutdown ends this unit's requests (interrupt, close): a stream
        # then cut by the worker's connection closing ends as the shutdown's `closed`, not as
        # a worker failure (whichever of the worker's frame and the break comes first).
        self._ending = False
        self._http = WorkerClient()
        self.card_row: dict[str, Any] | None = None
        self.startup: dict[str, float] = {}  # where its start went (worker_startup.py)

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    @property
    def ending(self) -> bool:
        """The server's shutdown is ending this unit's requests: a stream cut now is `closed`."""
        return self._ending

    def measured_bytes(self) -> int | None:
        """The worker's memory (RSS, or PSS when forked) at the last reading, never below the
        weights (memory_reading.py: a lease never waits for a reading)."""
        if self._closed:
            return None
        return self._measured_as(self._reading.last())

    async def refresh(self) -> None:
        if not self._closed:
            self._measured_as(await asyncio.to_thread(self._reading.now))

    async def give_back_idle_memory(self) -> None:
        """Have the idle worker's engine give back its KV pool now (`/admin/give-back`)."""
        if self._closed or not self.worker.alive():
            return
        with contextlib.suppress(httpx.HTTPError):
            await self.client().post("/admin/give-back", timeout=GIVE_BACK_ANSWER_S)

    def _measured_as(self, rss: int | None) -> int | None:
        if rss is not None:
            self._measured = max(rss, self.weights_bytes)
        return self._measured

    def broken(self) -> bool:
        return self.worker.exhausted()

    def pause(self) -> None:
        return None

    def resume(self) -> None:
        return None

    def interrupt(self) -> None:
        """End every request now (a forced shutdown; any thread): the worker's own drain ends
        each with its protocol's `closed` error; a worker that does not answer is killed."""
        self._ending = True
        if not self.worker.alive():
            return
        try:
            transport = httpx.HTTPTransport(uds=self.worker.socket_path)
            with httpx.Client(transport=transport, base_url="http://worker") as client:
                client.post(
                    "/admin/drain", json={"timeout_ms": 0, "force": True}, timeout=DRAIN_ANSWER_S
                ).raise_for_status()
        except httpx.HTTPError:
            self.worker.kill_now()

    async def close(self) -> bool:
        if not self._closed:
            self._closed = self._ending = True
            await self._http.aclose()
            await self.worker.stop()
        return True

    def client(self) -> httpx.AsyncClient:
        """An HTTP client on the worker's socket (a new one after the worker was respawned)."""
        return self._http.on(self.worker.socket_path)

    async def read_card(self) -> None:
        """Ask the worker for the row `/v1/models` lists for it (fixed for its lifetime)."""
        listed = await self.get_json("/v1/models")
        rows = listed.get("data") if listed is not None else None
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            self.card_row = rows[0]

    async def get_json(self, path: str) -> dict[str, Any] | None:
        """A GET on the worker (its /stats), or None when it cannot be reached or answers
        anything but 200."""
        if not await self.worker.ensure_alive():
            return None
        try:
            response = await self.client().get(path, timeout=10.0)
            value = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return value if isinstance(value, dict) else None
