"""The disk KV store by itself: blocks in and out by chain key, checked on every read, held to a
byte budget least recently used first, cleared whole or by model, shared safely by processes;
its size read from a running tally that every process sharing it keeps, never by listing it."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from modelhost.engine.kv.prefix_store import chain_key
from modelhost.residency.kv.kv_block_file import file_bytes
from modelhost.residency.kv.kv_store import KVDiskStore, ModelKVStore
from modelhost.residency.kv.kv_usage import RESCAN_S, TALLY_FILE

BLOCK = 1000  # payload bytes of a block in these tests
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)


def block(i: int) -> tuple[bytes, tuple[int, ...], bytes]:
    tokens = tuple(t + 8 * i for t in TOKENS)
    return chain_key(None, tokens), tokens, bytes([i % 256]) * BLOCK


def put(model: ModelKVStore, i: int) -> bytes:
    key, tokens, payload = block(i)
    model.put(key, None, tokens, payload)
    return key


def get(model: ModelKVStore, i: int) -> bytes | None:
    key, tokens, _ = block(i)
    found = model.get(key, None, tokens, BLOCK)
    return None if found is None else bytes(found)


def test_a_block_put_is_read_back_by_another_store_on_the_same_directory(tmp_path: Path) -> None:
    put(KVDiskStore(tmp_path, 1 << 20).for_model("m", "file-a"), 3)
    assert get(KVDiskStore(tmp_path, 1 << 20).for_model("m", "file-a"), 3) == block(3)[2]


def test_a_block_is_not_served_to_another_model_identity_nor_for_other_tokens(
    tmp_path: Path,
) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    key = put(store.for_model("m", "file-a"), 1)
    assert get(store.for_model("m", "file-b"), 1) is None  # the file changed: another folder
    other_tokens = tuple(range(100, 108))  # a key that collides with other tokens
    assert store.for_model("m", "file-a").get(key, None, other_tokens, BLOCK) is None


def test_a_torn_or_corrupt_file_is_ignored_and_removed(tmp_path: Path) -> None:
    model = KVDiskStore(tmp_path, 1 << 20).for_model("m", "file-a")
    for i, damage in enumerate(("truncate", "flip", "foreign")):
        key = put(model, i)
        path = model._path(key)
        data = bytearray(path.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[-10] ^= 0x01
        else:
            data[:4] = b"JUNK"
        path.write_bytes(bytes(data))
        assert get(model, i) is None
        assert not path.exists()


def test_the_budget_evicts_the_least_recently_used_blocks_first(tmp_path: Path) -> None:
    size = file_bytes(len(TOKENS), BLOCK)
    store = KVDiskStore(tmp_path, budget_bytes=10 * size)
    model = store.for_model("m", "file-a")
    for i in range(10):
        put(model, i)
        past = time.time() - 1000 + i  # each block used a second after the one before
        os.utime(model._path(block(i)[0]), (past, past))
    assert get(model, 0) is not None  # block 0 read now: the most recently used
    for i in range(10, 14):
        put(model, i)
    store.sweep()
    kept = {i for i in range(14) if model._path(block(i)[0]).exists()}
    assert store.usage().bytes <= 10 * size
    assert 0 in kept and {10, 11, 12, 13} <= kept
    assert 1 not in kept and 2 not in kept  # the oldest went first


def test_clear_empties_the_store_or_one_models_part(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    put(store.for_model("a", "file-a"), 1)
    put(store.for_model("b", "file-b"), 2)
    assert {m.id for m in store.usage().models} == {"a", "b"}
    removed = store.clear("a")
    assert [m.id for m in removed.models] == ["a"] and removed.files == 1
    assert [m.id for m in store.usage().models] == ["b"]
    store.clear()
    assert store.usage().files == 0


def test_a_store_with_no_budget_writes_nothing(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 0)
    put(store.for_model("m", "file-a"), 1)
    assert store.usage().files == 0


def _hammer(root: str, start: int, count: int) -> None:
    model = KVDiskStore(Path(root), 40 * file_bytes(len(TOKENS), BLOCK)).for_model("m", "f")
    for i in range(start, start + count):
        put(model, i % 60)
        get(model, (i * 7) % 60)


def test_two_processes_sharing_a_store_never_leave_a_bad_file_and_keep_the_budget(
    tmp_path: Path,
) -> None:
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_hammer, args=(str(tmp_path), n * 30, 300)) for n in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    store = KVDiskStore(tmp_path, 40 * file_bytes(len(TOKENS), BLOCK))
    store.sweep()
    model = store.for_model("m", "f")
    files = list(tmp_path.rglob("*.kvb"))
    assert files and not list(tmp_path.rglob("*.tmp"))
    for i in range(60):
        if model._path(block(i)[0]).exists():
            assert get(model, i) == block(i)[2]  # every file left is whole and its own
    assert store.usage().bytes <= 40 * file_bytes(len(TOKENS), BLOCK)


def count_listings(monkeypatch) -> list[str]:
    """Every directory listed from now on (os.scandir, os.listdir, Path.iterdir go through
    these two)."""
    listed: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path="."):  # type: ignore[no-untyped-def]
        listed.append(str(path))
        return real_scandir(path)

    def listdir(path="."):  # type: ignore[no-untyped-def]
        listed.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    return listed


def test_the_stores_size_is_read_from_its_tally_without_listing_a_file(
    tmp_path: Path, monkeypatch
) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    for i in range(5):
        put(store.for_model("a", "file-a"), i)
    put(store.for_model("b", "file-b"), 9)
    store.clear("b")
    listed = count_listings(monkeypatch)
    usage = store.usage()
    assert listed == []
    assert (usage.files, usage.bytes) == (5, 5 * file_bytes(len(TOKENS), BLOCK))
    assert [(m.id, m.files) for m in usage.models] == [("a", 5)]


def test_a_block_written_by_another_process_shows_at_once_and_once(tmp_path: Path) -> None:
    reader = KVDiskStore(tmp_path, 1 << 20)  # a server's front, say; a worker writes
    assert reader.usage().files == 0
    writer = KVDiskStore(tmp_path, 1 << 20).for_model("m", "file-a")
    put(writer, 1)
    put(writer, 1)  # the same block again: replaced, not counted twice
    put(writer, 2)
    usage = reader.usage()
    assert (usage.files, usage.bytes) == (2, 2 * file_bytes(len(TOKENS), BLOCK))


def test_a_bad_block_removed_on_reading_leaves_the_count(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    model = store.for_model("m", "file-a")
    put(model, 1)
    put(model, 2)
    path = model._path(block(1)[0])
    path.write_bytes(path.read_bytes()[:-1])
    assert get(model, 1) is None
    assert store.usage().files == 1


def test_a_count_that_drifted_is_set_right_by_a_walk_within_the_rescan_interval(
    tmp_path: Path, monkeypatch
) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    model = store.for_model("m", "file-a")
    for i in range(3):
        put(model, i)
    model._path(block(0)[0]).unlink()  # by hand: nothing counted it
    assert store.usage().files == 3  # believed for a while
    later = time.time() + RESCAN_S + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert store.usage().files == 2


def test_a_store_without_a_tally_is_counted_by_one_walk(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    put(store.for_model("m", "file-a"), 1)
    (tmp_path / TALLY_FILE).unlink()  # a store an older version wrote
    put(store.for_model("m", "file-a"), 2)
    assert store.usage().files == 2


def test_a_broken_tally_is_rebuilt_by_a_walk(tmp_path: Path) -> None:
    store = KVDiskStore(tmp_path, 1 << 20)
    put(store.for_model("m", "file-a"), 1)
    (tmp_path / TALLY_FILE).write_text('{"version": 1, "scanned')  # torn, or broken by hand
    assert store.usage().files == 1
    put(store.for_model("m", "file-a"), 2)
    assert store.usage().files == 2
