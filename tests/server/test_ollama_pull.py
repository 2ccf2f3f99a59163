"""Ollama's `/api/pull` against a real server on loopback and a stand-in hub (HF_ENDPOINT):
the official `ollama` client pulls, sees Ollama's progress, and the pulled model is listed
and answers at once, in the same running server; a pull by `modelhost pull` too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from live_server import LiveServer
from pull_world import GGUF_REPO, HF_REPO, ODD_REPO, hub, hub_cache, hub_files

from modelhost.assembly import build_stage
from modelhost.cli.main import main
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

__all__ = ["hub", "hub_files"]  # fixtures
pytestmark = pytest.mark.slow
PAGE = "http://app.example"  # a --cors-origin: it may chat, not pull


@pytest.fixture
def served(hub, models_dir, tmp_path) -> Iterator[dict[str, Any]]:
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "home", embedded=False, shape=ServingShape(batch=2)
    )
    settings = ServeSettings(cors_origins=(PAGE,))
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 << 30,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
    )
    router = ModelRouter(host, registry, current="tiny-a")
    with (
        LiveServer(create_routed_app(router, settings)) as server,
        ollama.Client(host=server.base_url, timeout=120) as client,
    ):
        yield {"client": client, "url": server.base_url, "hub": hub, "tmp": tmp_path}


def hub_cache_dir(served: dict[str, Any]) -> Path:
    return hub_cache(served["tmp"])


def names(client: ollama.Client) -> set[str]:
    return {str(m.model) for m in client.list().models}


def test_the_ollama_client_pulls_with_progress_and_the_model_answers_at_once(served):
    client = served["client"]
    assert "Tiny-Q8_0:latest" not in names(client)
    updates = list(client.pull(f"hf.co/{GGUF_REPO}:Q8_0", stream=True))
    statuses = [u.status for u in updates]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    files = [u for u in updates if u.digest]
    size = len(served["hub"].repos[GGUF_REPO].files["Tiny-Q8_0.gguf"])
    assert {u.digest for u in files} == {
        f"sha256:{served['hub'].sha256(GGUF_REPO, 'Tiny-Q8_0.gguf')}"
    }
    assert files[0].status == f"pulling {files[0].digest.removeprefix('sha256:')[:12]}"
    assert files[-1].total == size and files[-1].completed == size
    assert "Tiny-Q8_0:latest" in names(client)
    models = httpx.get(f"{served['url']}/v1/models").json()["data"]
    assert "Tiny-Q8_0" in {m["id"] for m in models}
    reply = client.generate(model="Tiny-Q8_0", prompt="hi", options={"num_predict": 2})
    assert reply.done and reply.eval_count
    # The name it was pulled by answers too, as Ollama's own hf.co pulls do.
    reply = client.generate(
        model=f"hf.co/{GGUF_REPO}:Q8_0", prompt="hi", options={"num_predict": 2}
    )
    assert reply.done and reply.eval_count
    assert [m.model for m in client.ps().models] == ["Tiny-Q8_0:latest"]  # one model, one unit


def test_a_pull_without_streaming_answers_success_once(served):
    reply = served["client"].pull(HF_REPO, stream=False)
    assert reply.status == "success"
    assert f"{HF_REPO}:latest" in names(served["client"])
    # Older clients (Open WebUI's first versions) name the model `name`.
    again = httpx.post(f"{served['url']}/api/pull", json={"name": HF_REPO, "stream": False})
    assert again.status_code == 200 and again.json() == {"status": "success"}


def test_pull_errors_come_in_ollama_shape_with_their_status(served):
    client = served["client"]
    for name, status, words in (
        ("nobody/no-such-model", 404, "'nobody/no-such-model' was not found"),
        (ODD_REPO, 400, "cannot be served"),
        ("llama3.2", 400, "USER/REPO[:QUANT]"),
    ):
        with pytest.raises(ollama.ResponseError) as raised:
            list(client.pull(name, stream=True))
        assert raised.value.status_code == status and words in raised.value.error
    served["hub"].repos[GGUF_REPO].gated = True
    with pytest.raises(ollama.ResponseError) as raised:
        client.pull(GGUF_REPO)
    assert raised.value.status_code == 401 and "HF_TOKEN" in raised.value.error


def test_a_checksum_mismatch_ends_the_stream_with_an_error_line_and_lists_nothing(served):
    served["hub"].repos[GGUF_REPO].wrong_sha256.add("Tiny-Q4_K_M.gguf")
    with httpx.stream("POST", f"{served['url']}/api/pull", json={"model": GGUF_REPO}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.strip()]
    assert "does not match the hub's checksum" in lines[-1] and lines[-1].startswith('{"error"')
    assert "Tiny-Q4_K_M:latest" not in names(served["client"])


def test_a_client_that_leaves_mid_pull_cancels_it_and_nothing_is_listed(served):
    hub, url = served["hub"], served["url"]
    hub.repos[GGUF_REPO].stall_at["Tiny-Q4_K_M.gguf"] = 4096
    with httpx.stream("POST", f"{url}/api/pull", json={"model": GGUF_REPO}) as response:
        for line in response.iter_lines():
            if '"digest"' in line:  # the file's download has begun
                break
    for _ in range(600):  # the server ends the pull's request once it sees the client gone
        if 'route="/api/pull"' in httpx.get(f"{url}/metrics").text:
            break
        time.sleep(0.05)
    hub.release.set()  # the rest of the file arrives: the pull must not keep it
    for _ in range(600):
        if not list(hub_cache_dir(served).rglob(".modelhost-pull-*")):
            break
        time.sleep(0.05)
    assert "Tiny-Q4_K_M:latest" not in names(served["client"])
    assert not [p for p in hub_cache_dir(served).rglob("*") if p.suffix == ".gguf"]


def test_a_model_pulled_by_the_cli_is_served_by_the_running_server_at_once(served, capsys):
    client = served["client"]
    assert f"{HF_REPO}:latest" not in names(client)  # the server has just scanned
    assert main(["pull", HF_REPO]) == 0
    assert capsys.readouterr().out.strip() == HF_REPO
    reply = client.chat(
        model=HF_REPO, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}
    )
    assert reply.done
    shown = client.show(HF_REPO)  # resident now: its sampling defaults are known
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.parameters is not None
    assert shown.parameters.splitlines() == ["temperature 0.6", "top_k 20"]


def test_pull_is_an_operator_action_a_cors_page_cannot_reach(served):
    headers = {"Origin": PAGE, "Host": served["url"].removeprefix("http://")}
    pulled = httpx.post(f"{served['url']}/api/pull", json={"model": GGUF_REPO}, headers=headers)
    assert pulled.status_code == 403
    listed = httpx.get(f"{served['url']}/api/tags", headers=headers)
    assert listed.status_code == 200
