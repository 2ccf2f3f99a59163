"""The adapters one base model serves: known by name, loaded on demand, least recently used
let go.

An adapter is *known* (its name and path, from `--adapter` or the admin route) and, while it
is used, *loaded* (fitted to the base, `row_adapters.LoraAdapter`). Past `max_loaded` adapters
the least recently used one that no row is running with is let go; a request naming it later
loads it again from its path, as an evicted model is. A row holds its `AdapterUse`, so an
adapter is never let go under a running row, and its bytes stay counted until it is.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from pathlib import Path

from modelhost.models.adapters.lora_files import read_lora
from modelhost.models.adapters.refusals import AdapterRefused, AdaptersBusy, UnknownAdapter
from modelhost.models.adapters.row_adapters import AdapterUse, LoraAdapter, RowAdapters, fit_adapter
from modelhost.models.loaded import LoadedModel
from modelhost.models.networks.decoder import DecoderLM

DEFAULT_MAX_LOADED = 16


class AdapterSet:
    def __init__(self, model: LoadedModel, max_loaded: int = DEFAULT_MAX_LOADED) -> None:
        self.model = model
        self.max_loaded = max(1, max_loaded)
        self._known: dict[str, str] = {}  # name -> path, in the order they were added
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recent first
        self._uses: weakref.WeakSet[AdapterUse] = weakref.WeakSet()
        self._rows: RowAdapters | None = None
        self._lock = threading.Lock()

    @property
    def rows(self) -> RowAdapters | None:
        """The network's hooks, once some adapter has been loaded."""
        return self._rows

    def names(self) -> list[str]:
        return list(self._known)

    def path(self, name: str) -> str | None:
        return self._known.get(name)

    def add(self, name: str, path: str) -> LoraAdapter:
        """Know and load `name` from `path` (replacing an adapter of that name); AdapterRefused
        when it does not fit the base. Blocking: reads the files."""
        adapter = self._fit(name, path)
        with self._lock:
            self._known[name] = path
            self._loaded.pop(name, None)
            self._make_room()
            self._loaded[name] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        """Forget `name`; rows running with it finish with it. False when it was not known."""
        with self._lock:
            self._loaded.pop(name, None)
            return self._known.pop(name, None) is not None

    def use(self, name: str, scale: float = 1.0) -> AdapterUse:
        """A row's use of `name` at `scale`, loading it when it was let go. Blocking."""
        with self._lock:
            adapter = self._loaded.get(name)
            path = self._known.get(name)
            if path is None:
                raise UnknownAdapter(name)
            if adapter is not None:
                self._loaded.move_to_end(name)
        if adapter is None:
            adapter = self._fit(name, path)
            with self._lock:
                self._make_room()
                self._loaded[name] = adapter
        use = AdapterUse(adapter, scale)
        self._uses.add(use)
        return use

    def loaded_bytes(self) -> int:
        """The loaded adapters' weights, those let go that running rows still hold, and the
        copies stacked for recent steps."""
        held = {id(use.adapter): use.adapter for use in list(self._uses)}
        with self._lock:
            held.update({id(adapter): adapter for adapter in self._loaded.values()})
        stacked = self._rows.stacked_bytes() if self._rows is not None else 0
        return stacked + sum(adapter.nbytes for adapter in held.values())

    def loaded(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._loaded.values())

    def in_use(self, name: str) -> int:
        """Rows (admitted, running or waiting) that run with `name` now."""
        return sum(1 for use in list(self._uses) if use.adapter.name == name)

    def _fit(self, name: str, path: str) -> LoraAdapter:
        network = self.model.network
        if not isinstance(network, DecoderLM):
            raise AdapterRefused(f"model '{self.model.id}' takes no adapters")
        lora = read_lora(Path(path))
        adapter = fit_adapter(name, lora, network, self.model.dtype)
        with self._lock:
            if self._rows is None:
                self._rows = self.model.row_adapters = RowAdapters(network)
        return adapter

    def _make_room(self) -> None:
        """Let go least recently used idle adapters until one more fits (lock held)."""
        busy = {use.adapter.name for use in list(self._uses)}
        while len(self._loaded) >= self.max_loaded:
            idle = next((n for n in self._loaded if n not in busy), None)
            if idle is None:
                raise AdaptersBusy(
                    f"all {self.max_loaded} loaded adapters have running requests; retry shortly"
                )
            del self._loaded[idle]
