"""A MODELHOST_HOME that cannot be written (read-only, full, or not a directory): models still load
and serve; the job store answers 503 saying why instead of failing each request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from modelhost.assembly import build_stage
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow


@pytest.fixture
def unwritable_home(tmp_path, monkeypatch) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    home = blocker / "home"  # every mkdir or write below it fails, whoever runs the tests
    monkeypatch.setenv("MODELHOST_HOME", str(home))
    return home


def test_a_server_whose_home_cannot_be_written_serves_models_and_refuses_jobs(
    models_dir, unwritable_home, tmp_path
):
    registry = ModelRegistry(
        [models_dir], hf_hub=tmp_path / "hub", embedded=False, shape=ServingShape(batch=2)
    )
    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=10**12,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
    )
    app = create_routed_app(ModelRouter(host, registry, current="tiny-a"), settings)
    with LiveServer(app) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        refused = client.post("/api/jobs", json={"kind": "eval-serve", "config": {}})
        assert refused.status_code == 503
        assert refused.json()["error"].startswith("the job store is unavailable")
        assert client.get("/api/jobs").status_code == 503


def test_a_gguf_model_loads_without_its_cache_when_home_cannot_be_written(unwritable_home):
    model = load_model("smollm2-135m-instruct")  # converted in a temporary folder this time
    assert model.tokenizer.encode("Paris") and model.weights_bytes > 0
    assert not unwritable_home.exists()
