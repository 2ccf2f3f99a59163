"""LoRA adapters through `modelhost serve BASE --adapter NAME=PATH`, in a worker process (the
default) and in-process: listed as models of their own, named by any surface as the `model`
(or the base plus `adapter` / `lora`), loaded and unloaded at run time, refused out loud."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from live_server import free_port
from test_serve_process import SERVE, wait_for_health
from tiny_lora import make_peft_adapter
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow
BASE = "lora-base"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, smollm2: Any) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-serving")
    base = make_tiny_checkpoint(root / BASE, "llama", smollm2, initializer_range=0.3)
    wide = make_tiny_checkpoint(root / "wide", "llama", smollm2, hidden_size=32)
    made = {"base": base}
    for name, seed in (("tone", 1), ("terse", 2), ("late", 3)):
        make_peft_adapter(base, root / name, seed=seed)
        made[name] = root / name
    make_peft_adapter(wide, root / "wide-adapter", seed=4)
    make_peft_adapter(base, root / "head", seed=5, targets=("q_proj", "lm_head"))
    made["wide-adapter"], made["head"] = root / "wide-adapter", root / "head"
    return made


@pytest.fixture(scope="module", params=["workers", "in-process"])
def base_url(request: pytest.FixtureRequest, files: dict[str, Path]) -> Iterator[str]:
    port = free_port()
    argv = [str(files["base"]), "--port", str(port), "--batch", "4", "--no-spare-worker"]
    argv += ["--adapter", f"tone={files['tone']}", "--adapter", f"terse={files['terse']}"]
    if request.param == "in-process":
        argv.append("--in-process")
    log_path = files["base"].parent / f"serve-{request.param}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def complete(url: str, **fields: Any) -> str:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_adapters_are_listed_as_models_with_their_base(base_url: str, files: dict[str, Path]):
    rows = {row["id"]: row for row in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert rows["tone"]["parent"] == BASE and rows["tone"]["adapter"] is True
    assert rows["tone"]["root"] == str(files["tone"].resolve())
    assert rows["terse"]["parent"] == BASE
    tags = {row["name"]: row for row in httpx.get(f"{base_url}/api/tags").json()["models"]}
    assert tags["tone:latest"]["details"]["parent_model"] == f"{BASE}:latest"


def test_an_adapter_named_as_the_model_or_beside_the_base_answers_alike(base_url: str):
    bare = complete(base_url, model=BASE)
    tone = complete(base_url, model="tone")
    assert tone != bare
    assert complete(base_url, model=BASE, adapter="tone") == tone
    assert complete(base_url, model=BASE, lora=[{"id": 0, "scale": 1.0}]) == tone
    assert complete(base_url, model=BASE, adapter={"name": "tone", "scale": 0.0}) == bare
    assert complete(base_url, model="terse") not in (bare, tone)


def test_every_surface_runs_the_adapter_the_model_names(base_url: str):
    messages = [{"role": "user", "content": "Say something."}]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with client:
        chat = client.chat.completions.create(
            model="tone", messages=messages, max_tokens=8, temperature=0
        )  # type: ignore[arg-type]
        base_chat = client.chat.completions.create(
            model=BASE, messages=messages, max_tokens=8, temperature=0
        )  # type: ignore[arg-type]
    with anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(
            model="tone", messages=messages, max_tokens=8, extra_body={"temperature": 0}
        )  # type: ignore[arg-type]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert chat.choices[0].message.content != base_chat.choices[0].message.content
    ollama = httpx.post(
        f"{base_url}/api/generate",
        json={"model": "tone", "prompt": PROMPT, "raw": True, "stream": False,
              "options": {"temperature": 0, "num_predict": 8}},
        timeout=120,
    )  # fmt: skip
    assert ollama.status_code == 200 and ollama.json()["response"] == complete(
        base_url, model="tone"
    )


def test_an_answer_names_the_adapter_it_ran_with_as_its_model(base_url: str):
    messages = [{"role": "user", "content": "Say something."}]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with client:
        chat = client.chat.completions.create(
            model="tone", messages=messages, max_tokens=2, temperature=0
        )  # type: ignore[arg-type]
        beside = client.chat.completions.create(
            model=BASE, messages=messages, max_tokens=2, extra_body={"adapter": "terse"}
        )  # type: ignore[arg-type]
        bare = client.chat.completions.create(model=BASE, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    with anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0) as claude:
        message = claude.messages.create(model="tone", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert (chat.model, beside.model, bare.model, message.model) == ("tone", "terse", BASE, "tone")


def test_an_unknown_adapter_beside_the_base_is_model_not_found(base_url: str):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with client, pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=4, extra_body={"adapter": "nope"}
        )
    assert refused.value.code == "model_not_found" and "nope" in refused.value.message


def test_an_adapter_loads_and_unloads_at_run_time(base_url: str, files: dict[str, Path]):
    body = {"name": "late", "path": str(files["late"])}
    loaded = httpx.post(f"{base_url}/api/adapters", json=body, timeout=120)
    assert loaded.status_code == 200 and loaded.json()["bytes"] > 0
    listed = httpx.get(f"{base_url}/api/adapters").json()["data"]
    assert {row["name"]: row["loaded"] for row in listed}["late"] is True
    assert complete(base_url, model="late") != complete(base_url, model=BASE)
    assert httpx.delete(f"{base_url}/api/adapters/late").status_code == 200
    assert "late" not in {row["id"] for row in httpx.get(f"{base_url}/v1/models").json()["data"]}
    gone = httpx.post(
        f"{base_url}/v1/completions", json={"model": BASE, "prompt": PROMPT, "adapter": "late"}
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("base_url", ["workers"], indirect=True)  # a worker to kill
def test_a_worker_restarted_after_a_crash_still_serves_the_adapters_loaded_at_run_time(
    base_url: str, files: dict[str, Path]
):
    body = {"name": "late", "path": str(files["late"])}
    assert httpx.post(f"{base_url}/api/adapters", json=body, timeout=120).status_code == 200
    try:
        before = complete(base_url, model="late")
        pid = next(row["pid"] for row in httpx.get(f"{base_url}/engine").json()["workers"])
        os.kill(pid, signal.SIGKILL)
        assert complete(base_url, model="late") == before
        restarted = next(row for row in httpx.get(f"{base_url}/engine").json()["workers"])
        assert restarted["pid"] != pid and restarted["restarts"] == 1
    finally:
        httpx.delete(f"{base_url}/api/adapters/late")


@pytest.mark.parametrize(
    ("adapter", "says"),
    [("wide-adapter", "does not fit this base"), ("head", "cannot patch")],
)
def test_an_adapter_the_base_cannot_serve_is_refused_with_why(
    base_url: str, files: dict[str, Path], adapter: str, says: str
):
    body = {"name": adapter, "path": str(files[adapter])}
    refused = httpx.post(f"{base_url}/api/adapters", json=body, timeout=120)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "adapter_refused" and says in error["message"]
    assert adapter not in {
        row["name"] for row in httpx.get(f"{base_url}/api/adapters").json()["data"]
    }
