"""Whisper base, joined once from its two packages; faster-whisper directories recognised."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from modelhost.audio.transcriber import load_transcriber
from modelhost.audio.whisper_files import WHISPER_BASE, is_whisper_dir, whisper_base_dir

PART_BYTES = 94_371_840 + 50_845_767  # model.bin.part1 + model.bin.part2


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MODELHOST_HOME", str(tmp_path))
    return tmp_path


def test_whisper_base_is_joined_into_modelhost_home_with_its_tokenizer(home: Path) -> None:
    directory = whisper_base_dir()
    assert directory == home / "models" / WHISPER_BASE
    assert (directory / "model.bin").stat().st_size == PART_BYTES
    for name in ("config.json", "tokenizer.json", "vocabulary.json"):
        assert (directory / name).is_file()
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_a_joined_model_is_not_written_again(home: Path) -> None:
    model = whisper_base_dir() / "model.bin"
    before = model.stat().st_mtime_ns
    assert whisper_base_dir() / "model.bin" == model
    assert model.stat().st_mtime_ns == before


def test_a_model_cut_short_is_joined_again(home: Path) -> None:
    model = whisper_base_dir() / "model.bin"
    with open(model, "r+b") as file:
        file.truncate(1000)
    assert (whisper_base_dir() / "model.bin").stat().st_size == PART_BYTES


def test_the_joined_directory_is_a_whisper_directory(whisper_dir: Path) -> None:
    assert is_whisper_dir(whisper_dir)


def test_a_copy_without_its_tokenizer_is_not_served(whisper_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "whisper-copy"
    copy.mkdir()
    for name in ("config.json", "vocabulary.json"):
        shutil.copy(whisper_dir / name, copy / name)
    os.symlink(whisper_dir / "model.bin", copy / "model.bin")
    assert not is_whisper_dir(copy)


def test_other_ctranslate2_and_hugging_face_directories_are_not_whisper(tmp_path: Path) -> None:
    translator = tmp_path / "opus-mt"
    translator.mkdir()
    for name in ("model.bin", "tokenizer.json", "vocabulary.json"):
        (translator / name).write_bytes(b"x")
    (translator / "config.json").write_text(json.dumps({"add_source_bos": False}))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (llama / "model.safetensors").write_bytes(b"x")
    assert not is_whisper_dir(translator)
    assert not is_whisper_dir(llama)
    assert not is_whisper_dir(tmp_path / "missing")


def test_a_directory_that_is_not_whisper_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a faster-whisper model directory"):
        load_transcriber(tmp_path, "nothing")


def test_loading_whisper_leaves_the_process_free_to_reach_the_hub(
    whisper_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    stage = load_transcriber(whisper_dir, WHISPER_BASE, cpu_threads=1)
    try:
        # An in-process server pulls after loading it; pulling refuses an offline hub.
        assert "HF_HUB_OFFLINE" not in os.environ
    finally:
        stage.close()
