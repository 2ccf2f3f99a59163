"""`/stats`' `kv_store` part follows the prefix KV store on disk as it changes: a block a worker
writes shows at the next call, and `DELETE /api/kv` empties it (read from the store's running
tally, not by listing its files); `disk_caches` shows each model's packed weights and blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from modelhost.engine.kv.prefix_store import chain_key
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.kv.kv_block_file import file_bytes
from modelhost.residency.kv.kv_store import KVDiskStore
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)
PAYLOAD = b"\x01" * 1000


async def never_loads(entry, progress) -> InProcessUnit:  # type: ignore[no-untyped-def]
    raise AssertionError("these tests load no model")


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    monkeypatch.setenv("MODELHOST_HOME", str(tmp_path / "home"))
    registry = ModelRegistry(home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False)
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**9, source=registry.get, load=never_loads
    )
    settings = ServeSettings(kv_disk_bytes=1 << 30)
    app = create_routed_app(ModelRouter(host, registry, current="none"), settings)
    with LiveServer(app) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client


def kv_store(client: httpx.Client) -> dict:  # type: ignore[type-arg]
    response = client.get("/stats")
    assert response.status_code == 200
    return response.json()["kv_store"]


def test_stats_shows_a_block_written_to_the_store_and_none_after_a_clear(
    server: httpx.Client, tmp_path: Path
) -> None:
    assert (kv_store(server)["files"], kv_store(server)["bytes"]) == (0, 0)
    worker = KVDiskStore(tmp_path / "home" / "kv", 1 << 30).for_model("model-a", "file-a")
    worker.put(chain_key(None, TOKENS), None, TOKENS, PAYLOAD)  # as a model's worker would

    written = kv_store(server)
    assert written["files"] == 1 and written["bytes"] == file_bytes(len(TOKENS), len(PAYLOAD))
    assert [(m["id"], m["files"]) for m in written["models"]] == [("model-a", 1)]

    cleared = server.delete("/api/kv")
    assert cleared.status_code == 200
    assert cleared.json()["removed"]["files"] == 1
    after = kv_store(server)
    assert (after["files"], after["bytes"], after["models"]) == (0, 0, [])


def test_stats_shows_each_models_packed_copy_and_kv_blocks_on_disk(
    server: httpx.Client, tmp_path: Path
) -> None:
    from synthetic_files import write_tiny

    from modelhost.paths import file_cache_key, gguf_cache_root

    model = write_tiny(tmp_path / "home" / "models" / "tiny-a.gguf", "Q4_0")
    folder = gguf_cache_root() / file_cache_key(model)
    folder.mkdir(parents=True)
    with open(folder / "packed-build-auto.bin", "wb") as packed:
        packed.truncate(5000)
    store = KVDiskStore(tmp_path / "home" / "kv", 1 << 30)
    store.for_model("tiny-a", "file-a").put(chain_key(None, TOKENS), None, TOKENS, PAYLOAD)

    caches = server.get("/stats").json()["disk_caches"]
    assert caches["packed_bytes"] == 5000
    (row,) = caches["models"]
    assert (row["id"], row["packed_bytes"], row["kv_blocks"]) == ("tiny-a", 5000, 1)
    assert row["kv_bytes"] == file_bytes(len(TOKENS), len(PAYLOAD))
