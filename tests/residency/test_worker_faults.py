"""Models that cannot be served: a worker that hangs while loading and a model file cut short.
Each is a clear 502 in the calling protocol's shape, leaves no process or lease behind, and the
server keeps serving its other models."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer
from routed_world import FakeRegistry

from modelhost.assembly import worker_loader
from modelhost.residency.host import ResidencyHost
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.workers.worker_unit import WorkerUnit
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow
START_TIMEOUT_S = 25.0  # a tiny model's worker starts well within it, even on a busy machine
HANG_TIMEOUT_S = 6.0  # `hangs` never answers: how long the test waits to see it given up on


@pytest.fixture
def faulty(models_dir, tmp_path) -> Iterator[dict[str, Any]]:
    """tiny-a (good), `hangs` (its weights are a FIFO nobody writes) and `cut` (weights cut)."""
    registry = ModelRegistry(
        [models_dir], home=tmp_path / "h", hf_hub=tmp_path / "hub", embedded=False,
        shape=ServingShape(batch=2),
    )  # fmt: skip
    good = registry.get("tiny-a")
    assert good is not None
    hangs = tmp_path / "hangs"
    shutil.copytree(good.path, hangs)
    for weights in hangs.glob("*.safetensors"):
        weights.unlink()
        os.mkfifo(weights)  # opening it for reading waits for a writer forever
    cut = tmp_path / "cut"
    shutil.copytree(good.path, cut)
    weights = next(cut.glob("*.safetensors"))
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # the header survives; the tensors do not
    entries = {
        "tiny-a": good,
        "hangs": replace(good, id="hangs", path=hangs),
        "cut": replace(good, id="cut", path=cut),
    }
    loaders = [
        worker_loader(ServeSettings(), batch=2, start_timeout_s=timeout)
        for timeout in (START_TIMEOUT_S, HANG_TIMEOUT_S)
    ]
    host: ResidencyHost[WorkerUnit] = ResidencyHost(
        budget_bytes=10**12,
        source=FakeRegistry(entries).get,
        load=lambda entry, progress: loaders[entry.id == "hangs"](entry, progress),
    )
    router = ModelRouter(host, FakeRegistry(entries), current="tiny-a")
    before = set(_children())
    with LiveServer(create_routed_app(router, ServeSettings())) as server:
        yield {"url": server.base_url, "host": host}
    assert host.resident() == []
    assert set(_children()) <= before  # no worker outlived the server


def _children() -> list[int]:
    """Processes whose parent is this test process."""
    mine = str(os.getpid())
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        if fields.get("PPid", "").strip() == mine and "Z" not in fields.get("State", ""):
            found.append(int(status.parent.name))
    return found


def test_a_worker_that_hangs_while_loading_is_a_502_and_the_others_keep_serving(faulty):
    hello = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=f"{faulty['url']}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="hangs", messages=hello)
        assert failed.value.status_code == 502
        assert failed.value.body["code"] == "load-failed"  # type: ignore[index]
        assert "did not answer" in failed.value.body["message"]  # type: ignore[index]
        reply = client.chat.completions.create(model="tiny-a", messages=hello, max_tokens=2)
    assert reply.model == "tiny-a"
    assert [m.id for m in faulty["host"].resident()] == ["tiny-a"]  # no slot left for `hangs`


def test_a_truncated_model_file_is_a_502_in_each_protocols_shape(faulty):
    with (
        anthropic.Anthropic(base_url=faulty["url"], api_key="x", max_retries=0) as sdk,
        pytest.raises(anthropic.APIStatusError) as failed,
    ):
        sdk.messages.create(model="cut", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert failed.value.status_code == 502
    assert failed.value.body["type"] == "error"  # type: ignore[index]
    raw = httpx.post(
        f"{faulty['url']}/v1/responses", json={"model": "cut", "input": "hi"}, timeout=60
    )
    assert raw.status_code == 502 and raw.json()["error"]["code"] == "load-failed"
    ok = httpx.post(
        f"{faulty['url']}/v1/completions",
        json={"model": "tiny-a", "prompt": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["model"] == "tiny-a"
