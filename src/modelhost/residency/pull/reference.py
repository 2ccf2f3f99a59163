"""What a pull names: `hf.co/USER/REPO[:QUANT]` or `USER/REPO[:QUANT]` (also
`huggingface.co/...` and `https://` forms), and the errors a pull answers with.

QUANT picks a GGUF repo's file, compared case-insensitively as llama-server's `-hf
user/repo:Q4_K_M` does; none (or Ollama's `:latest`) means Q4_K_M, or the repo's only GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_QUANT = "Q4_K_M"
_HOSTS = ("hf.co/", "huggingface.co/")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_QUANT = re.compile(r"^[\w.-]+$")


class PullError(Exception):
    """A pull that cannot go on: `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class HubReference:
    repo_id: str  # USER/REPO
    quant: str | None  # None: the default (DEFAULT_QUANT, or the only GGUF)
    revision: str = "main"

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "")


def parse_reference(text: object) -> HubReference:
    """The repo and quantization a pull's argument names; a 400 for anything else."""
    if not isinstance(text, str) or not text.strip():
        raise PullError(400, "model is required: a Hugging Face repo, USER/REPO[:QUANT]")
    name = text.strip().removeprefix("https://").removeprefix("http://")
    for host in _HOSTS:
        if name.lower().startswith(host):
            name = name[len(host) :]
    repo_id, _, quant = name.partition(":")
    repo_id = repo_id.strip("/")
    if not _REPO.match(repo_id) or (quant and not _QUANT.match(quant)):
        raise PullError(
            400,
            f"'{text}' is not a Hugging Face repo: pull USER/REPO[:QUANT] "
            "(say, hf.co/bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M)",
        )
    if quant.lower() == "latest":  # what Ollama clients add to a name without a tag
        quant = ""
    return HubReference(repo_id, quant or None)
