"""The residency host: which models are loaded, under a byte budget, and who holds them.

A request acquires a `Lease` on a model; the host loads the model if needed, first draining least
recently used idle models when the budget needs room. A leased model is never evicted: a newcomer
that only a leased model could make room for waits, then swaps. Loading, measuring and closing
are injected (a unit is an in-process engine or a worker), so this module does no I/O; asyncio
is used only to wait for leases, loads and drains. The victim choice is `policy.choose_victims`.

Bytes of a resident: what it *holds* (the unit's own measurement once it has one, never below the
weights; the entry's estimate before that and while loading) plus what its leases may still *claim*
(`unit.claim_bytes`: one step's working memory and a full context of KV a lease, capped at the KV
pool's ceiling, and the bound of the disk KV store's writer queue, which only running rows fill;
what that queue still holds once they end is in the unit's measurement). A model's KV pool grows
with use and shrinks once idle for its `--kv-hold`, so an idle model soon costs about its weights;
before any model is evicted for room, the idle ones are asked to shrink theirs at once, least
recently used first (`_give_back_idle`: an agent's prompt stays in memory while the budget has
room, and never costs another model its residency); a lease is one admitted
request, and the claim is reserved when the lease is taken: a new lease on a resident model whose
claim does not fit drains idle models, or waits for busy ones, exactly as a load does; a load needs
the estimate plus one lease's claim. Each engine caps its own rows at its pool's ceiling, and no row
outgrows a full context, so no model grows past what was counted for it: a burst of long rows queues
(at the host, or in the engine's own queue) and never overruns the budget. The claim is counted on
top of what a busy model already holds (its committed KV included): an over-count while requests
run, never an under-count.

`used = max(Σ counted + external, measured − counted of the model being placed)`: a
process-wide measurement acts as a floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from modelhost.residency.lease import Lease
from modelhost.residency.policy import Decision, Plan, choose_victims
from modelhost.residency.unit import (
    LoadProgress,
    Pause,
    ResidencyError,
    ResidentModel,
    Servable,
    Unit,
    claim_bytes,
)

log = logging.getLogger("modelhost.models")


U = TypeVar("U", bound=Unit)


@dataclass(slots=True, eq=False)
class _Slot(Generic[U]):
    entry: Servable
    loaded: asyncio.Future[None]
    unit: U | None = None
    state: str = "loading"  # loading | ready | draining
    leases: int = 0
    pinned: bool = False
    last_used_at: float = 0.0
    uses: int = 0
    drained: asyncio.Task[bool] | None = None
    progress: LoadProgress = field(default_factory=LoadProgress)
    hold_s: float | None = None  # a client's keep-alive for this model (None: the host's hold)
    release_when_idle: bool = False  # a client asked for it to go once its last response ends
    given_back_at_use: int = -1  # `uses` when it last gave back its idle memory (its KV pool)

    def __post_init__(self) -> None:
        self.progress.model_id = self.entry.id


def _no_event(name: str, payload: dict[str, Any]) -> None:
    return None


def _plain_fit(decision: Decision) -> bool:
    """Fits as things are: nothing evicted, nobody waited for."""
    return decision.fits and not decision.victims


def _load_need(entry: Servable) -> int:
    """What loading a model for a request needs: what it holds, and that request's claim."""
    return entry.estimate_bytes + claim_bytes(entry, 1)


class ResidencyHost(Generic[U]):
    def __init__(
        self,
        *,
        budget_bytes: int,
        source: Callable[[str], Servable | None],
        load: Callable[[Servable, LoadProgress], Awaitable[U]],
        measure: Callable[[], int | None] = lambda: None,
        external: Callable[[], int] = lambda: 0,
        publish: Callable[[str, dict[str, Any]], None] = _no_event,
        switch: Callable[[str], Awaitable[None]] | None = None,
        clock: Callable[[], float] = time.time,
        hold_s: float = 0.0,
        available: Callable[[], int | None] = lambda: None,
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError("the residency budget must be positive")
        self.budget_bytes = budget_bytes
        self.hold_s = hold_s
        self._source, self._load, self._measure = source, load, measure
        self._external, self._switch, self._clock = external, switch, clock
        self._available = available  # memory the machine can still give (None: unknown)
        self._listeners: list[Callable[[str, dict[str, Any]], None]] = [publish]
        self._slots: dict[str, _Slot[U]] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pauses = 0
        self._closed = False
        self._closing: asyncio.Task[None] | None = None

    # -- leasing ---------------------------------------------------------------------------

    async def acquire(
        self, model_id: str, *, need: str | None = None, body: bytes | None = None
    ) -> Lease[U]:
        """A lease on `model_id`, loading it (and draining others) first when needed.
        Cancelling the caller while it waits leaves nothing behind. (`body`, the request's, is
        a cluster's to read: one machine holds one copy of each model.)"""
        self._refuse_if_closed()
        entry = self._source(model_id)
        if entry is None:
            raise ResidencyError("does-not-fit", f"model '{model_id}' is not a local model")
        if need is not None and need not in entry.operations:
            raise ResidencyError("does-not-fit", f"model '{model_id}' cannot {need}")
        waiting_since = self._clock()
        while True:
            self._refuse_if_closed()
            slot = self._slots.get(model_id)
            if slot is not None:
                if slot.state == "draining":  # never lend a closing engine: wait, then reload
                    await self._wait_change()
                    continue
                if slot.unit is not None and slot.leases == 0 and slot.unit.broken():
                    await self._start_evict(slot, "broken")
                    continue
                more = self._claim_more(slot)
                if more <= 0:
                    return await self._lend(slot)
                # On the request path: the residents' last readings, not fresh ones (a cluster
                # node's would cost a round trip); a claim is counted in full either way.
                waited_s = self._clock() - waiting_since
                need_bytes = self._counted(slot) + more
                decision = self._decide(need_bytes, model_id, waited_s=waited_s)
                if await self._give_back_idle(need_bytes, model_id, waited_s, decision):
                    continue
                if decision.wait:
                    await self._wait_change(timeout_s=self._hold_left(waited_s))
                    continue
                evictions = [self._start_evict(self._slots[v], "evicted") for v in decision.victims]
                return await self._lend_after(slot, evictions)
            if self._pauses:
                await self._wait_change()
                continue
            await self._refresh()
            if model_id in self._slots or self._closed:
                continue  # the world changed while we read the units
            self._refuse_beyond_the_machine(entry)
            waited_s = self._clock() - waiting_since
            decision = self._decide(_load_need(entry), model_id, waited_s=waited_s)
            if await self._give_back_idle(_load_need(entry), model_id, waited_s, decision):
                continue
            if decision.wait:
                await self._wait_change(timeout_s=self._hold_left(waited_s))
                continue
            # Reserve the slot now and load once the victims are gone: the room they leave is
            # this request's, and a waiter woken by the drain cannot take it (no thrashing).
            evictions = [self._start_evict(self._slots[v], "evicted") for v in decision.victims]
            return await self._lend(self._start_load(entry, after=evictions))

    async def _lend(self, slot: _Slot[U]) -> Lease[U]:
        slot.leases += 1  # reserved before any await, so concurrent acquirers share one load
        if slot.state == "loading":
            try:
                await asyncio.shield(slot.loaded)
            except BaseException:
                slot.leases -= 1
                self._wake()
                raise
        assert slot.unit is not None and slot.state == "ready"
        slot.uses += 1
        return Lease(slot.entry.id, slot.unit, lambda: self._release(slot))

    async def _lend_after(
        self, slot: _Slot[U], evictions: Sequence[asyncio.Task[bool]]
    ) -> Lease[U]:
        """A lease taken now (its claim is this request's from here on), returned once the
        victims that make room for the claim have drained."""
        lease = await self._lend(slot)
        try:
            await asyncio.gather(*evictions, return_exceptions=True)
        except BaseException:
            lease.release()
            raise
        return lease

    def _release(self, slot: _Slot[U]) -> None:
        slot.leases -= 1
        slot.last_used_at = self._clock()
        if slot.leases == 0 and slot.release_when_idle and slot.state == "ready":
            self._start_evict(slot, "keep-alive 0")
        self._wake()

    def peek_on(self, model_id: str, node_name: str) -> U | None:
        """`peek`: one machine is the only node."""
        return self.peek(model_id)

    def nodes_view(self) -> list[dict[str, Any]] | None:
        """None: one machine has no nodes to show (a cluster's host lists its own)."""
        return None

    def peek(self, model_id: str) -> U | None:
        """The resident unit of `model_id`, without a lease."""
        slot = self._slots.get(model_id)
        return slot.unit if slot is not None and slot.state == "ready" else None

    # -- loading ---------------------------------------------------------------------------

    def _start_load(self, entry: Servable, after: Sequence[asyncio.Task[bool]] = ()) -> _Slot[U]:
        loop = asyncio.get_running_loop()
        slot: _Slot[U] = _Slot(entry, loop.create_future(), last_used_at=self._clock())
        # Every acquirer awaits the future; one that gives up must not leave it unretrieved.
        slot.loaded.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._slots[entry.id] = slot
        self._spawn(self._run_load(slot, after))
        return slot

    async def _run_load(self, slot: _Slot[U], after: Sequence[asyncio.Task[bool]]) -> None:
        entry = slot.entry
        await asyncio.gather(*after, return_exceptions=True)  # the victims' memory comes back first
        started = time.perf_counter()
        self._publish("model.load", {"id": entry.id, "phase": "started"})
        try:
            unit = await self._load(entry, slot.progress)
        except Exception as exc:
            self._slots.pop(entry.id, None)
            self._publish("model.load", {"id": entry.id, "phase": "failed", "error": str(exc)})
            message = f"model '{entry.id}' failed to load: {exc}"
            error = ResidencyError("load-failed", message)
            error.__cause__ = exc  # a cluster places again when the node could not be reached
            slot.loaded.set_exception(error)
            self._wake()
            return
        if self._closed:  # the host closed during the load: the unit never serves
            self._slots.pop(entry.id, None)
            with contextlib.suppress(Exception):
                await unit.close()
            slot.loaded.set_exception(ResidencyError("closed", "the server is closing"))
            self._wake()
            return
        slot.unit, slot.state, slot.last_used_at = unit, "ready", self._clock()
        ms = (time.perf_counter() - started) * 1000
        self._announce_loaded(entry, unit, ms)
        slot.loaded.set_result(None)
        self._wake()

    def adopt(self, entry: Servable, unit: U, *, pin: bool = False, load_ms: float = 0.0) -> None:
        """Register a model its caller already loaded (the startup model)."""
        if entry.id in self._slots:
            raise ResidencyError("already-resident", f"model '{entry.id}' is already resident")
        loaded = asyncio.get_running_loop().create_future()
        loaded.set_result(None)
        self._slots[entry.id] = _Slot(
            entry, loaded, unit, "ready", pinned=pin, last_used_at=self._clock()
        )
        self._announce_loaded(entry, unit, load_ms)
        self._wake()

    def _announce_loaded(self, entry: Servable, unit: U, ms: float) -> None:
        payload = {"id": entry.id, "phase": "finished", "ms": ms, "resumed": unit.resumed}
        self._publish("model.load", {**payload, "weights_bytes": entry.weights_bytes})

    # -- eviction --------------------------------------------------------------------------

    def _start_evict(self, slot: _Slot[U], reason: str) -> asyncio.Task[bool]:
        if slot.drained is None:
            slot.state = "draining"  # at once: nobody may lease it from here on
            slot.drained = self._spawn(self._drain(slot, reason))
        return slot.drained

    async def _drain(self, slot: _Slot[U], reason: str) -> bool:
        assert slot.unit is not None
        model_id = slot.entry.id
        log.info("[models] %s draining (%s); flushing saved state before release", model_id, reason)
        started = time.perf_counter()
        flushed = False
        try:
            flushed = bool(await slot.unit.close())
        finally:
            if self._slots.get(model_id) is slot:
                del self._slots[model_id]
            drain_ms = (time.perf_counter() - started) * 1000
            self._publish(
                "model.unload",
                {"id": model_id, "reason": reason, "drain_ms": drain_ms, "flushed": flushed},
            )
            self._publish("model.memory", {"id": model_id, "weights_bytes": 0})
            state = "state saved" if flushed else "state NOT durable"
            log.info("[models] %s released (%s)", model_id, state)
            self._wake()
        return flushed

    async def unload(self, model_id: str, *, force: bool = False) -> bool | None:
        """Drain `model_id`; the answer is whether its state was saved (None: not resident).
        A leased model is refused with `in-use` unless `force`."""
        slot = self._slots.get(model_id)
        if slot is None:
            return None
        if slot.state == "loading":
            with contextlib.suppress(ResidencyError):
                await asyncio.shield(slot.loaded)
            return await self.unload(model_id, force=force)
        if slot.leases and not force and slot.drained is None:
            raise ResidencyError(
                "in-use", f"model '{model_id}' is serving {slot.leases} request(s)"
            )
        return await self._start_evict(slot, "requested")

    def evict_broken(self) -> None:
        """Start evicting each idle unit that can no longer serve (a worker out of restarts),
        as the next lease on it would: whoever watches the units need not wait for a request."""
        for slot in list(self._slots.values()):
            unit = slot.unit
            if slot.state == "ready" and unit is not None and not slot.leases and unit.broken():
                self._start_evict(slot, "broken")

    async def make_room(self, num_bytes: int) -> None:
        """Drain LRU models until `num_bytes` more fit; wait while they are all leased."""
        while True:
            self._refuse_if_closed()
            if self._pauses:
                await self._wait_change()
                continue
            await self._refresh()
            decision = self._decide(num_bytes, None, waited_s=float("inf"))
            if await self._give_back_idle(num_bytes, None, float("inf"), decision):
                continue
            if decision.wait:
                await self._wait_change()
            elif decision.victims:
                evictions = [self._start_evict(self._slots[v], "evicted") for v in decision.victims]
                await asyncio.gather(*evictions, return_exceptions=True)
            else:
                return

    # -- deciding --------------------------------------------------------------------------

    def _held(self, slot: _Slot[U]) -> int:
        measured = slot.unit.measured_bytes() if slot.unit is not None else None
        if measured is None:
            return slot.entry.estimate_bytes
        return max(measured, slot.entry.weights_bytes)

    @staticmethod
    def _claim_more(slot: _Slot[U]) -> int:
        """What one more lease on `slot` adds to its claim."""
        return claim_bytes(slot.entry, slot.leases + 1) - claim_bytes(slot.entry, slot.leases)

    def _counted(self, slot: _Slot[U]) -> int:
        """What the budget counts for a resident: what it holds and what its leases may claim."""
        return self._held(slot) + claim_bytes(slot.entry, slot.leases)

    def used_bytes(self, except_id: str | None = None) -> int:
        held = {model_id: self._counted(slot) for model_id, slot in self._slots.items()}
        others = sum(b for model_id, b in held.items() if model_id != except_id)
        others += self._external()
        measured = self._measure()
        if measured is None:
            return others
        return max(others, measured - held.get(except_id or "", 0))

    def hold_of(self, slot: _Slot[U]) -> float:
        """How long `slot` is held after its last response: a client's keep-alive, else ours."""
        return self.hold_s if slot.hold_s is None else slot.hold_s

    def _held_back(self, slot: _Slot[U], waited_s: float) -> bool:
        """Inside its hold after a response, unless the waiter has waited longer than the hold."""
        hold_s = self.hold_of(slot)
        recent = self._clock() - slot.last_used_at < hold_s
        return recent and waited_s < hold_s and slot.uses > 0

    def _hold_left(self, waited_s: float) -> float | None:
        longest = max([self.hold_s, *(self.hold_of(s) for s in self._slots.values())])
        return max(longest - waited_s, 0.01) if longest > 0 else None

    def _decide(self, need_bytes: int, except_id: str | None, *, waited_s: float) -> Decision:
        others = [s for model_id, s in self._slots.items() if model_id != except_id]
        idle = [
            s for s in others
            if s.state == "ready" and s.leases == 0 and not s.pinned
            and not self._held_back(s, waited_s)
        ]  # fmt: skip
        idle.sort(key=lambda s: s.last_used_at)
        busy = any(not s.pinned and s not in idle for s in others)
        candidates = [(s.entry.id, self._held(s)) for s in idle]
        used = self.used_bytes(except_id)
        return choose_victims(self.budget_bytes, used, need_bytes, candidates, others_busy=busy)

    async def _give_back_idle(
        self, need_bytes: int, except_id: str | None, waited_s: float, decision: Decision
    ) -> bool:
        """Before any model is evicted for room (`decision`, when it does not fit as things
        are): ask the idle models, least recently used first, to give back the memory they
        keep only for their next request (an engine's KV pool, held for `--kv-hold` after its
        last row), until `need_bytes` fits with no eviction; last, when the alternative is to
        evict or wait, `except_id` itself if resident and idle (a lease counts its own kept KV
        beside a full context's claim: its prompt is read back from the disk store instead).
        True when any was asked (decide again); False when none is left to ask. A model gives
        back once a use: asking again before its next request frees nothing."""
        if _plain_fit(decision):
            return False
        evicts = bool(decision.victims) or decision.wait
        idle = [
            s for s in self._slots.values()
            if s.state == "ready" and s.leases == 0 and s.unit is not None
            and s.given_back_at_use != s.uses and (evicts or s.entry.id != except_id)
        ]  # fmt: skip
        idle.sort(key=lambda s: (s.entry.id == except_id, s.last_used_at))
        asked = False
        for slot in idle:
            if asked and _plain_fit(self._decide(need_bytes, except_id, waited_s=waited_s)):
                break
            if slot.state != "ready" or slot.leases or slot.unit is None:
                continue  # leased or drained meanwhile
            slot.given_back_at_use = slot.uses
            asked = True
            with contextlib.suppress(Exception):  # a unit that cannot is evicted as before
                await slot.unit.give_back_idle_memory()
                await slot.unit.refresh()
        return asked

    def _refuse_beyond_the_machine(self, entry: Servable) -> None:
        """A model the machine cannot hold even once every other unpinned model is gone is
        refused now, not left to the kernel's OOM killer halfway through its load."""
        room = self._available()
        if room is None:
            return
        freeable = sum(
            self._held(s) for s in self._slots.values() if s.state == "ready" and not s.pinned
        )
        if _load_need(entry) > room + freeable:
            need_gb, room_gb = _load_need(entry) / 1e9, (room + freeable) / 1e9
            message = (
                f"model '{entry.id}' needs {need_gb:.2f} GB (weights, KV pool and working "
                f"memory) and this machine has {room_gb:.2f} GB to give it"
            )
            raise ResidencyError("does-not-fit", message)

    def plan(self, model_id: str) -> Plan:
        """What loading `model_id` would take now, victims least recently used first."""
        if model_id in self._slots:
            return Plan(fits=True, required_bytes=0, free_bytes=self._free(model_id), evict=())
        entry = self._source(model_id)
        if entry is None:
            raise ResidencyError("does-not-fit", f"model '{model_id}' is not a local model")
        decision = self._decide(_load_need(entry), model_id, waited_s=float("inf"))
        return Plan(
            fits=decision.fits,
            required_bytes=_load_need(entry),
            free_bytes=self._free(model_id),
            evict=decision.victims,
        )

    def _free(self, except_id: str | None) -> int:
        return max(0, self.budget_bytes - self.used_bytes(except_id))

    async def refresh(self) -> None:
        """Take every resident's current reading (before asking `plan` about a new model)."""
        await self._refresh()

    async def _refresh(self) -> None:
        """Ask every resident for a current reading before deciding who fits."""
        ready = [s.unit for s in self._slots.values() if s.state == "ready" and s.unit is not None]
        if ready:
            await asyncio.gather(*(unit.refresh() for unit in ready), return_exceptions=True)

    # -- pins, pauses, switching -----------------------------------------------------------

    def pin(self, model_id: str, pinned: bool = True) -> bool:
        slot = self._slots.get(model_id)
        if slot is None:
            return False
        slot.pinned = pinned
        self._wake()
        return True

    def unpin(self, model_id: str) -> bool:
        return self.pin(model_id, False)

    def keep_alive(self, model_id: str, seconds: float) -> bool:
        """A client's keep-alive for a resident model: below 0 pins it; 0 releases it once its
        last response ends (at once when it has none); more holds it that long after its last
        response (then it is an idle model like any other). False when it is not resident."""
        slot = self._slots.get(model_id)
        if slot is None or slot.state == "draining":
            return False
        slot.pinned = seconds < 0
        slot.release_when_idle = seconds == 0
        slot.hold_s = seconds if seconds > 0 else None
        if slot.release_when_idle and slot.leases == 0 and slot.state == "ready":
            self._start_evict(slot, "keep-alive 0")
        self._wake()
        return True

    async def pause_all(self) -> Pause:
        """Pause every resident unit and hold back loads and evictions until `dispose()`.
        A draining model is waited for, never paused, so a job never holds a closing engine."""
        while any(s.state == "draining" for s in self._slots.values()):
            await self._wait_change()
        self._pauses += 1
        units = [self._slots[i].unit for i in sorted(self._slots) if self._slots[i].unit]
        for unit in units:
            assert unit is not None
            unit.pause()

        def dispose() -> None:
            for unit in units:
                assert unit is not None
                unit.resume()
            self._pauses -= 1
            self._wake()

        return Pause(dispose)

    async def serve(self, model_id: str) -> None:
        """Make `model_id` current through the composition's switch."""
        if self._switch is None:
            raise ResidencyError("not-switchable", "this host serves one model")
        await self._switch(model_id)

    def subscribe(self, listener: Callable[[str, dict[str, Any]], None]) -> None:
        """Also tell `listener` of every load, unload and memory event (metrics, logs)."""
        self._listeners.append(listener)

    def _publish(self, name: str, payload: dict[str, Any]) -> None:
        for listener in self._listeners:
            try:
                listener(name, payload)
            except Exception:  # a listener never breaks residency
                log.exception("residency event listener failed on %s", name)

    # -- views -----------------------------------------------------------------------------

    def resident(self) -> list[ResidentModel]:
        return [
            ResidentModel(
                id=model_id,
                state=slot.state,
                bytes=self._held(slot),
                pinned=slot.pinned,
                leases=slot.leases,
                last_used_at=slot.last_used_at,
                hold_s=self.hold_of(slot),
                operations=tuple(slot.entry.operations),
                role="primary" if "generate" in slot.entry.operations else "companion",
                progress=slot.progress.fraction if slot.state == "loading" else None,
            )
            for model_id, slot in self._slots.items()
        ]

    def check_invariants(self) -> None:
        for model_id, slot in self._slots.items():
            assert slot.entry.id == model_id
            assert slot.leases >= 0, f"{model_id}: negative leases"
            assert (slot.unit is None) == (slot.state == "loading"), f"{model_id}: unit vs state"
            assert (slot.drained is not None) == (slot.state == "draining")
        staying = [s for s in self._slots.values() if s.state != "draining"]
        used = sum(self._counted(s) for s in staying) + self._external()
        # Over the budget only when a model is served alone (nothing unpinned beside it).
        assert used <= self.budget_bytes or sum(not s.pinned for s in staying) <= 1, "over budget"

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> asyncio.Task[None]:
        """Refuse new work, wait for loads in flight, then drain every model, pinned ones too.
        Idempotent: every caller awaits the same close."""
        if self._closing is None:
            self._closed = True
            self._wake()
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return self._closing

    async def _close(self) -> None:
        loading = [s.loaded for s in self._slots.values() if s.state == "loading"]
        await asyncio.gather(*loading, return_exceptions=True)
        drains = [self._start_evict(s, "closing") for s in list(self._slots.values()) if s.unit]
        results = await asyncio.gather(*drains, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise ExceptionGroup("models failed to close", errors)

    @property
    def closed(self) -> bool:
        return self._closed

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise ResidencyError("closed", "the server is closing")

    # -- plumbing --------------------------------------------------------------------------

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout_s: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
