"""Tokenizer files parsed ahead, for the processes forked after.

`tokenizers` parses a `tokenizer.json` holding the GIL throughout, and a large vocabulary takes
long: Gemma 3's 262k tokens and 515k merges ~1 s (and ~290 MB), most of a switch back to a model
that was evicted. The fork server (residency/workers/fork_server.py) parses the tokenizer of
each model loaded (`keep_tokenizer_file`), and every worker forked after inherits it, its pages
shared until written: `read_tokenizer_file` gives the kept object for the same file (path,
size and modification time), and parses any other. Only the last `KEEP` files are kept.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from tokenizers import Tokenizer as TokenizerBackend

KEEP = 2

_FileIdentity = tuple[str, int, int]  # path, size, modification time (ns)
_kept: OrderedDict[_FileIdentity, TokenizerBackend] = OrderedDict()


def _identity(path: Path) -> _FileIdentity | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return str(path.resolve()), found.st_size, found.st_mtime_ns


def read_tokenizer_file(path: Path) -> TokenizerBackend:
    """The tokenizer in `path`: the one kept for it when the file is unchanged, else parsed."""
    identity = _identity(path)
    kept = _kept.get(identity) if identity is not None else None
    return kept if kept is not None else TokenizerBackend.from_file(str(path))


def keep_tokenizer_file(path: Path) -> bool:
    """Parse `path` now and keep it for `read_tokenizer_file` here and in processes forked
    from here (dropping the file kept longest ago beyond `KEEP`); False when it cannot be read
    or parsed."""
    identity = _identity(path)
    if identity is None:
        return False
    if identity in _kept:
        _kept.move_to_end(identity)
        return True
    for older in [kept for kept in _kept if kept[0] == identity[0]]:
        del _kept[older]  # an earlier version of the same file
    try:
        _kept[identity] = TokenizerBackend.from_file(str(path))
    except Exception:  # noqa: BLE001 - not a tokenizer: a load reads and reports it
        return False
    while len(_kept) > KEEP:
        _kept.popitem(last=False)
    return True


def kept_tokenizer_files() -> list[str]:
    """The paths kept, the one kept longest ago first."""
    return [identity[0] for identity in _kept]


def parsed_ahead(backend: TokenizerBackend) -> bool:
    """Whether `backend` is one kept here (read, not parsed, by this process's load)."""
    return any(backend is kept for kept in _kept.values())
