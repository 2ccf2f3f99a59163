"""`modelhost cache ls|clear` and `modelhost ls`: the disk each model's caches take (its packed
weights copy, its blocks in the prefix KV store), and removing them, all of them or one
model's, one cache or both; a packed copy a live process maps is kept, and said so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_files import write_tiny

from modelhost.cli.main import main
from modelhost.engine.kv.prefix_store import chain_key
from modelhost.paths import file_cache_key, gguf_cache_root
from modelhost.residency.disk_caches import packed_files
from modelhost.residency.kv.kv_store import KVDiskStore

PACKED_BYTES = 3 * 10**7  # 0.03 GB


def put_block(store: KVDiskStore, model_id: str, i: int) -> None:
    """One KV block of `model_id`'s, as its worker writes it."""
    tokens = tuple(range(8 * i, 8 * i + 8))
    store.for_model(model_id, "file").put(chain_key(None, tokens), None, tokens, b"\x01" * 1000)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MODELHOST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "home" / "models").mkdir(parents=True)
    return tmp_path / "home"


def packed_copy(model_file: Path, mode: str = "auto") -> Path:
    """A packed weights file where a load of `model_file` keeps one (its size is what counts)."""
    folder = gguf_cache_root() / file_cache_key(model_file)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"packed-build-{mode}.bin"
    with open(path, "wb") as out:
        out.truncate(PACKED_BYTES)
    return path


@pytest.fixture
def two_models(home: Path) -> tuple[Path, Path]:
    """tiny-a with a packed copy and two KV blocks, tiny-b with a packed copy only."""
    a = write_tiny(home / "models" / "tiny-a.gguf", "Q4_0")
    b = write_tiny(home / "models" / "tiny-b.gguf", "Q4_0")
    packed_copy(a)
    packed_copy(b)
    store = KVDiskStore(home / "kv", 1 << 20)
    put_block(store, "tiny-a", 1)
    put_block(store, "tiny-a", 2)
    return a, b


def table(out: str) -> dict[str, list[str]]:
    """The rows of a printed table by their first cell (the header's first cell is its key)."""
    lines = out.split("\n\n")[0].splitlines()
    return {line.split()[0]: line.split() for line in lines if line.strip()}


def test_cache_ls_shows_each_models_packed_copy_and_its_kv_blocks(
    two_models: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert rows["MODEL"] == ["MODEL", "PACKED", "KV-STORE"]
    assert rows["tiny-a"][1:] == ["0.03", "GB", "0.00", "GB", "(2", "blocks)"]
    assert rows["tiny-b"][1:] == ["0.03", "GB", "-"]
    assert f"packed weights 0.06 GB in {home / 'cache' / 'gguf'}" in out
    assert f"KV store 0.00 GB (2 blocks) in {home / 'kv'}" in out


def test_a_packed_copy_of_a_file_no_longer_listed_shows_under_its_folders_name(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = write_tiny(home / "old.gguf", "Q4_0")  # outside every place models are found
    folder = packed_copy(gone).parent.name
    assert main(["cache", "ls"]) == 0
    assert table(capsys.readouterr().out)[folder][1:] == ["(no", "listed", "model's", "file)"] + [
        "0.03",
        "GB",
        "-",
    ]


def test_ls_shows_each_models_packed_copy_and_kv_blocks_on_disk(
    two_models: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", "--url", "http://127.0.0.1:9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start, end = lines[0].index("PACKED"), lines[0].index("WINDOW")
    disk = {line.split()[0]: line[start:end].split("  ") for line in lines[1:] if line.strip()}
    assert [cell.strip() for cell in disk["tiny-a"] if cell.strip()] == ["0.03 GB", "0.00 GB"]
    assert [cell.strip() for cell in disk["tiny-b"] if cell.strip()] == ["0.03 GB", "-"]
    assert f"packed weights 0.06 GB in {home / 'cache' / 'gguf'}" in lines[-1]
    assert "KV store 0.00 GB (2 blocks)" in lines[-1]


def test_cache_clear_with_a_model_and_packed_removes_only_that_models_packed_copy(
    two_models: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = two_models
    assert main(["cache", "clear", "tiny-a", "--packed"]) == 0
    assert "removed 0.03 GB of packed weights" in capsys.readouterr().out
    assert not list((gguf_cache_root() / file_cache_key(a)).glob("packed-*"))
    assert list((gguf_cache_root() / file_cache_key(b)).glob("packed-*"))
    assert KVDiskStore(home / "kv").usage().files == 2  # its KV blocks stay


def test_cache_clear_kv_removes_the_stores_blocks_and_keeps_the_packed_copies(
    two_models: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "clear", "--kv"]) == 0
    assert "(2 blocks)" in capsys.readouterr().out
    assert KVDiskStore(home / "kv").usage().files == 0
    assert len(list(gguf_cache_root().glob("*/packed-*.bin"))) == 2


def test_cache_clear_removes_both_caches_of_every_model(
    two_models: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "clear"]) == 0
    assert "removed 0.06 GB of packed weights" in capsys.readouterr().out
    assert not list(gguf_cache_root().glob("*/packed-*.bin"))
    assert KVDiskStore(home / "kv").usage().files == 0


def test_cache_clear_keeps_a_packed_copy_a_running_process_maps_and_names_the_process(
    two_models: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = two_models
    (mapped,) = (gguf_cache_root() / file_cache_key(a)).glob("packed-*.bin")
    holder = subprocess.Popen(  # maps it as a resident model's worker does
        [sys.executable, "-c", MAP_AND_WAIT, str(mapped)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        assert main(["cache", "clear", "--packed"]) == 0
    finally:
        holder.communicate("")
    out = capsys.readouterr().out
    assert "removed 0.03 GB of packed weights" in out  # tiny-b's
    assert f"kept {mapped}: mapped by process {holder.pid}" in out
    assert mapped.exists()


MAP_AND_WAIT = """
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
sys.stdin.read()
"""


def test_cache_clear_of_an_unknown_model_fails_and_says_so(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cache", "clear", "nope"]) == 2
    assert "'nope' is not a local model" in capsys.readouterr().err


def test_a_folder_that_goes_while_the_cache_is_listed_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loading worker renames its `.partial-PID` folder into place while /stats lists.
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "packed-abc.bin").write_bytes(b"\0" * 10)
    (tmp_path / "model.partial-15511").mkdir()
    scandir = os.scandir

    def going(path):  # type: ignore[no-untyped-def]
        if str(path).endswith(".partial-15511"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", going)
    assert [(f.path.name, f.bytes) for f in packed_files(tmp_path)] == [("packed-abc.bin", 10)]
