"""Jobs against a live server over the real SmolLM2: `echo` logprobs on /v1/completions, the
`eval-serve` job, and a short `bench-serve`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest
from job_helpers import submit, wait_for
from live_server import LiveServer

from modelhost.assembly import build_app
from modelhost.engine.engine import Engine, EngineConfig
from modelhost.jobs.eval_serve import SAMPLE_TEXT
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def smollm2_server(
    smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    # Its job store (opened by the first job route) lives in a home of the module's: the first
    # test's own home (conftest.py) goes when that test passes.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODELHOST_HOME", str(tmp_path_factory.mktemp("served-jobs-home")))
        engine = Engine(smollm2, EngineConfig(batch=4))
        server = LiveServer(build_app(engine, smollm2, ServeSettings())).start()
        assert httpx.get(f"{server.base_url}/api/jobs", timeout=60).status_code == 200
    yield server
    server.stop()


@pytest.fixture
def client(smollm2_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=smollm2_server.base_url, timeout=120) as client:
        yield client


def test_echo_with_logprobs_scores_the_prompt_tokens_before_the_completion(
    client: httpx.Client,
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2}
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    assert len(logprobs["tokens"]) == prompt_tokens + 2
    assert "".join(logprobs["tokens"][:prompt_tokens]) == PROMPT
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]


def test_echo_without_logprobs_puts_the_prompt_before_the_text(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain
    assert echoed["choices"][0]["logprobs"] is None


def test_a_streamed_echo_sends_the_prompt_in_the_first_chunk(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True}
    text = client.post("/v1/completions", json=body).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None


def test_an_eval_serve_job_reports_perplexity_and_the_multiple_choice_check(
    client: httpx.Client,
) -> None:
    text = " ".join(SAMPLE_TEXT.split()[:120])  # two chunks of ~400 characters
    job = wait_for(
        client, submit(client, "eval-serve", {"text": text, "chunk_chars": 400}), timeout_s=120
    )
    assert job["status"] == "done", job["error"]
    events = [
        json.loads(line[5:])
        for line in client.get(f"/api/jobs/{job['id']}/stream").text.splitlines()
        if line.startswith("data:")
    ]
    perplexity = [e for e in events if e.get("stage") == "perplexity"]
    assert len(perplexity) == 2  # one per chunk
    done = events[-2]
    results = done["results"]
    assert 1.0 < results["perplexity"] < 60.0  # SmolLM2 scores ~20-30 on chunks this short
    assert math.isclose(results["perplexity"], perplexity[-1]["perplexity"])
    assert results["choices"]["total"] == 4
    # A 135M model is a weak judge; the check reports its score, whatever it is.
    assert 0 <= results["choices"]["correct"] <= 4
    assert [a["expected"] for a in results["choices"]["answers"]] == [
        "paris",
        "blue",
        "zero",
        "seven",
    ]
    assert done["summary"].startswith("perplexity ")


def test_a_bench_serve_job_measures_the_served_model(client: httpx.Client) -> None:
    config = {"concurrency": [2], "prompt_tokens": 32, "max_tokens": 6, "requests": 2}
    job = wait_for(client, submit(client, "bench-serve", config), timeout_s=120)
    assert job["status"] == "done", job["error"]
    levels = client.get(f"/api/jobs/{job['id']}/stream").text
    results = json.loads([ln for ln in levels.splitlines() if '"type":"done"' in ln][0][5:])
    for level in results["results"]["levels"]:
        assert level["ok"] == 2
        assert level["completion_tokens"] == 12  # ignore_eos: every stream runs to max_tokens
        assert 20 <= level["prompt_tokens"] <= 44
