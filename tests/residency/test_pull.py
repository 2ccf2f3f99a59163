"""Pulling from the hub (a stand-in on loopback, HF_ENDPOINT): the files a reference means,
the checks before any weight is fetched, resumption, checksums, and what a failed pull leaves
(nothing that lists as a model)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from hub_standin import StandInHub
from pull_world import ALIEN_REPO, GGUF_REPO, HF_REPO, ODD_REPO, hub, hub_cache, hub_files

from modelhost.cli.main import main
from modelhost.residency.pull.marker import pulling
from modelhost.residency.pull.puller import PullCancelled, PullProgress, fetch, prepare
from modelhost.residency.pull.reference import HubReference, PullError, parse_reference
from modelhost.residency.registry import ModelRegistry

__all__ = ["hub", "hub_files"]  # fixtures


def listed(tmp_path: Path) -> dict[str, str | None]:
    """What the registry lists from the cache: id -> refusal."""
    registry = ModelRegistry([], home=tmp_path / "home", embedded=False)
    return {entry.id: entry.refusal for entry in registry.entries()}


def pull(name: str) -> Path:
    return fetch(prepare(name))


def got(hub: StandInHub, repo: str) -> set[str]:
    """The files whose bodies were fetched whole (not a header's range)."""
    return {f.file for f in hub.fetches if f.repo == repo and f.method == "GET" and not f.range}


def test_a_reference_names_a_repo_and_a_quantization():
    assert parse_reference("hf.co/bartowski/Llama-3B-GGUF:q4_k_m") == HubReference(
        "bartowski/Llama-3B-GGUF", "q4_k_m"
    )
    assert parse_reference("https://huggingface.co/org/name") == HubReference("org/name", None)
    assert parse_reference("org/name:latest") == HubReference("org/name", None)
    with pytest.raises(PullError, match="is not a Hugging Face repo") as error:
        parse_reference("llama3.2")
    assert error.value.status == 400


def test_a_gguf_repo_gives_the_file_of_the_quantization_asked_in_any_case(hub, tmp_path, capsys):
    assert main(["pull", f"hf.co/{GGUF_REPO}:q8_0"]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == "Tiny-Q8_0"
    assert "pulling Tiny-Q8_0.gguf (" in said.err  # off a terminal: a line naming each file
    assert got(hub, GGUF_REPO) == {"Tiny-Q8_0.gguf"}
    assert listed(tmp_path) == {"Tiny-Q8_0": None}


def test_a_gguf_repo_gives_q4_k_m_when_no_quantization_is_named(hub, tmp_path):
    path = pull(GGUF_REPO)
    assert path.name == "Tiny-Q4_K_M.gguf" and path.is_relative_to(hub_cache(tmp_path))
    assert got(hub, GGUF_REPO) == {"Tiny-Q4_K_M.gguf"}
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_a_quantization_the_repo_lacks_is_a_404_naming_those_it_has(hub, tmp_path):
    with pytest.raises(PullError) as error:
        prepare(f"{GGUF_REPO}:Q2_K")
    assert error.value.status == 404
    assert "no Q2_K GGUF file" in error.value.message and "Q8_0" in error.value.message


def test_a_safetensors_repo_gives_the_files_a_model_needs_config_last(hub, tmp_path):
    plan = prepare(HF_REPO)
    names = [f.name for f in plan.files]
    assert names[0] == "model.safetensors" and names[-1] == "config.json"
    assert "README.md" not in names and "tokenizer.json" in names
    path = fetch(plan)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert listed(tmp_path) == {HF_REPO: None}


def test_a_connection_cut_short_resumes_from_what_was_written(hub, tmp_path):
    data = hub.repos[GGUF_REPO].files["Tiny-Q4_K_M.gguf"]
    # Cut past the hub client's first 10 MiB chunk: it writes whole chunks, resumes after them.
    hub.repos[GGUF_REPO].cut_once["Tiny-Q4_K_M.gguf"] = len(data) - (1 << 20)
    path = pull(f"{GGUF_REPO}:Q4_K_M")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    gets = [f for f in hub.fetches if f.file == "Tiny-Q4_K_M.gguf" and f.method == "GET"]
    first_cut = next(f for f in gets if not f.range)
    assert first_cut.sent == len(data) - (1 << 20)
    resumed = gets[gets.index(first_cut) + 1]
    resumed_from = len(data) - resumed.sent
    assert 0 < resumed_from <= first_cut.sent  # not from the start
    assert resumed.range == f"bytes={resumed_from}-"
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_a_checksum_mismatch_removes_the_file_and_nothing_is_listed(hub, tmp_path):
    hub.repos[GGUF_REPO].wrong_sha256.add("Tiny-Q4_K_M.gguf")
    with pytest.raises(PullError, match="does not match the hub's checksum") as error:
        pull(GGUF_REPO)
    assert error.value.status == 502
    assert listed(tmp_path) == {}
    cached = [p for p in hub_cache(tmp_path).rglob("*") if p.is_file() and "blobs" in p.parts]
    assert cached == []


def test_an_unsupported_quantization_is_refused_from_its_header_alone(hub, hub_files, tmp_path):
    with pytest.raises(PullError) as error:
        prepare(ODD_REPO)
    assert error.value.status == 400
    # The reason `modelhost ls` gives for the same file on disk.
    odd = hub_files[ODD_REPO]["Odd-IQ4_XS.gguf"]
    local = ModelRegistry([odd], home=tmp_path / "home", hf_hub=tmp_path / "none", embedded=False)
    [entry] = local.entries()
    assert error.value.message == f"Odd-IQ4_XS.gguf cannot be served: {entry.refusal}"
    assert "IQ4_XS" in error.value.message
    size = len(hub.repos[ODD_REPO].files["Odd-IQ4_XS.gguf"])
    gets = [f for f in hub.fetches if f.repo == ODD_REPO and f.method == "GET"]
    assert gets and all(f.range for f in gets)  # range requests only
    assert hub.sent(ODD_REPO, "Odd-IQ4_XS.gguf") < size // 4  # the header, not the weights
    assert listed(tmp_path) == {}


def test_an_unsupported_architecture_is_refused_before_its_weights_are_fetched(hub, tmp_path):
    with pytest.raises(PullError, match="rwkv7") as error:
        prepare(ALIEN_REPO)
    assert error.value.status == 400
    weights = len(hub.repos[ALIEN_REPO].files["model.safetensors"])
    assert 0 < hub.sent(ALIEN_REPO, "model.safetensors") < weights // 4
    assert listed(tmp_path) == {}


def test_an_unknown_repo_is_a_404_naming_it(hub):
    with pytest.raises(PullError) as error:
        prepare("nobody/no-such-model:Q4_K_M")
    assert error.value.status == 404
    assert "'nobody/no-such-model' was not found" in error.value.message


def test_a_gated_repo_without_a_token_is_a_401_that_says_what_to_do(hub, monkeypatch, tmp_path):
    hub.repos[GGUF_REPO].gated = True
    with pytest.raises(PullError) as error:
        prepare(GGUF_REPO)
    assert error.value.status == 401
    assert "gated" in error.value.message and "HF_TOKEN" in error.value.message
    monkeypatch.setenv("HF_TOKEN", hub.token)
    pull(GGUF_REPO)
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_a_cancelled_pull_leaves_nothing_listed(hub, tmp_path):
    cancel = threading.Event()

    def report(progress: PullProgress) -> None:
        if progress.completed:  # the first bytes arrived
            cancel.set()

    with pytest.raises(PullCancelled):
        fetch(prepare(GGUF_REPO), report, cancel=cancel)
    assert listed(tmp_path) == {}
    assert not [p for p in hub_cache(tmp_path).rglob("*.incomplete")]


def test_files_a_pull_is_still_writing_are_not_listed(hub, tmp_path):
    pull(GGUF_REPO)
    repo_dir = hub_cache(tmp_path) / f"models--{GGUF_REPO.replace('/', '--')}"
    with pulling(repo_dir, ["Tiny-Q4_K_M.gguf"]):
        assert listed(tmp_path) == {}
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_the_cli_says_why_a_pull_is_refused(hub, capsys):
    assert main(["pull", "nobody/nothing"]) == 1
    assert "modelhost pull: repo 'nobody/nothing' was not found" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written_is_a_503_naming_it_and_nothing_is_listed(
    hub, monkeypatch, tmp_path, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("HF_HOME", str(blocker / "hf"))  # every mkdir below it fails
    with pytest.raises(PullError) as error:
        pull(GGUF_REPO)
    assert error.value.status == 503
    assert str(blocker / "hf" / "hub") in error.value.message and "HF_HOME" in error.value.message
    assert main(["pull", GGUF_REPO]) == 1  # the CLI says so, no traceback
    assert "could not write the Hugging Face cache" in capsys.readouterr().err


def test_offline_a_pull_is_a_503_that_says_why(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PullError, match="HF_HUB_OFFLINE is set") as error:
        prepare(GGUF_REPO)
    assert error.value.status == 503
    assert hub.fetches == []


def test_a_pull_already_in_the_cache_fetches_no_weights_again(hub, tmp_path):
    def whole_gets() -> int:
        return sum(1 for f in hub.fetches if f.method == "GET" and not f.range)

    pull(GGUF_REPO)
    assert whole_gets() == 1
    pull(GGUF_REPO)  # its header is read again (ranges), its checksum checked again
    assert whole_gets() == 1
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_a_pull_that_does_not_fit_on_the_disk_is_a_507_before_any_weight(hub, monkeypatch):
    from modelhost.residency.pull import checks

    class Full:
        free = 1 << 20

    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: Full())
    with pytest.raises(PullError, match="not enough free disk") as error:
        prepare(GGUF_REPO)
    assert error.value.status == 507
    assert got(hub, GGUF_REPO) == set()


def test_the_name_a_pull_took_finds_the_pulled_model(hub, tmp_path):
    pull(f"{GGUF_REPO}:Q8_0")
    pull(HF_REPO)
    registry = ModelRegistry([], home=tmp_path / "home", embedded=False)
    for name, model_id in (
        (f"hf.co/{GGUF_REPO}:q8_0", "Tiny-Q8_0"),
        (f"{GGUF_REPO}:Q8_0", "Tiny-Q8_0"),
        (f"hf.co/{HF_REPO}:latest", HF_REPO),
    ):
        entry = registry.get(name)
        assert entry is not None and entry.id == model_id, name
    assert registry.get(f"{GGUF_REPO}:Q4_K_M") is None  # not pulled


class Terminal:
    """`modelhost pull` run on a pseudo-terminal 100 columns wide; what it drew so far."""

    def __init__(self, *args: str) -> None:
        self.master, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        # A child inherits an ignored SIGINT (and Python then installs no KeyboardInterrupt
        # for it), which the test process may carry from earlier tests in a full run: the pull
        # starts as a terminal's would, with SIGINT at its default.
        inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "modelhost", "pull", *args],
                stdin=child, stdout=child, stderr=child, start_new_session=True,
            )  # fmt: skip
        finally:
            signal.signal(signal.SIGINT, inherited)
        os.close(child)
        self.shown = b""

    def read_until(self, wanted: bytes) -> bool:
        while wanted not in self.shown:
            ready, _, _ = select.select([self.master], [], [], 60)
            try:
                chunk = os.read(self.master, 4096) if ready else b""
            except OSError:  # the child closed its end
                chunk = b""
            if not chunk:
                return False
            self.shown += chunk
        return True

    def finish(self) -> int:
        self.read_until(b"\0")  # to the end
        os.close(self.master)
        return self.process.wait(timeout=60)


def test_on_a_terminal_a_pull_draws_a_bar_named_by_its_file(hub, tmp_path):
    terminal = Terminal(GGUF_REPO)
    assert terminal.finish() == 0
    shown = terminal.shown.decode(errors="replace")
    assert "Tiny-Q4_K_M.gguf: 100%|" in shown and "/resolve/" not in shown
    assert shown.rstrip().endswith("Tiny-Q4_K_M")
    assert listed(tmp_path) == {"Tiny-Q4_K_M": None}


def test_ctrl_c_in_a_terminal_stops_the_pull_and_nothing_is_listed(hub, tmp_path):
    hub.repos[GGUF_REPO].stall_at["Tiny-Q4_K_M.gguf"] = 4096
    terminal = Terminal(GGUF_REPO)
    try:
        assert terminal.read_until(b"Tiny-Q4_K_M.gguf:")  # the download has begun
        terminal.process.send_signal(signal.SIGINT)
        # What the terminal showed and what the hub served say why, when a full run fails it.
        status = terminal.finish()
        assert status == 130, (terminal.shown.decode(errors="replace")[-1500:], hub.fetches)
    finally:
        hub.release.set()
    assert b"cancelled; nothing was kept" in terminal.shown
    assert listed(tmp_path) == {}
    assert not list(hub_cache(tmp_path).rglob(".modelhost-pull-*"))
