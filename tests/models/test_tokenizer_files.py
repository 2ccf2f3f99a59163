"""Tokenizer files parsed ahead: a load reads the kept tokenizer of an unchanged file, parses a
file changed since, and only the last two files stay kept."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from modelhost.models.loading import tokenizer_files
from modelhost.models.loading.tokenizer_files import (
    keep_tokenizer_file,
    kept_tokenizer_files,
    parsed_ahead,
    read_tokenizer_file,
)


@pytest.fixture(autouse=True)
def nothing_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_files, "_kept", OrderedDict())


def write_tokenizer(path: Path, words: list[str]) -> Path:
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def test_a_kept_tokenizer_is_what_a_load_of_the_same_file_reads(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "a" / "tokenizer.json", ["hello", "world"])
    assert keep_tokenizer_file(path)
    read = read_tokenizer_file(path)
    assert parsed_ahead(read)
    assert read.encode("hello world").ids == [1, 2]
    assert read is read_tokenizer_file(path)


def test_a_file_changed_after_it_was_kept_is_parsed_again(tmp_path: Path) -> None:
    path = write_tokenizer(tmp_path / "a" / "tokenizer.json", ["hello", "world"])
    assert keep_tokenizer_file(path)
    write_tokenizer(path, ["world", "hello", "again"])
    later = os.stat(path).st_mtime_ns + 1_000_000
    os.utime(path, ns=(later, later))  # a file system's coarse clock: the change shows anyway
    read = read_tokenizer_file(path)
    assert not parsed_ahead(read)
    assert read.encode("hello world").ids == [2, 1]


def test_only_the_last_two_files_kept_stay_kept(tmp_path: Path) -> None:
    paths = [write_tokenizer(tmp_path / m / "tokenizer.json", [m]) for m in ("a", "b", "c")]
    for path in paths:
        assert keep_tokenizer_file(path)
    assert kept_tokenizer_files() == [str(paths[1]), str(paths[2])]
    assert not parsed_ahead(read_tokenizer_file(paths[0]))
    assert keep_tokenizer_file(paths[1])  # kept again: now the most recent
    assert kept_tokenizer_files() == [str(paths[2]), str(paths[1])]


def test_a_file_that_is_missing_or_not_a_tokenizer_is_not_kept(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"model": 1}')
    assert not keep_tokenizer_file(tmp_path / "broken.json")
    assert not keep_tokenizer_file(tmp_path / "missing.json")
    assert kept_tokenizer_files() == []
