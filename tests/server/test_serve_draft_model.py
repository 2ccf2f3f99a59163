"""A draft model seen from outside: SmolLM2 served with a tiny draft model that shares its
tokenizer, through the official SDKs; the answers are SmolLM2's own, the usage, `/stats` and
`/metrics` count the draft's guesses; a draft with another tokenizer, or `--speculate draft`
without one, is refused."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_gguf import write_gguf_from_hf
from tiny_models import make_tiny_checkpoint

from modelhost.assembly import build_serving
from modelhost.cli import serve as cli_serve
from modelhost.cli import serve_args as cli_serve_args
from modelhost.engine.draft_model import DraftMismatch
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.embedded import EMBEDDED
from modelhost.server.settings import ServeSettings

MODEL = "smollm2-135m-instruct"
ASK: list[Any] = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
def draft_path(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_checkpoint(directory, "llama", smollm2, num_hidden_layers=1)
    return write_gguf_from_hf(directory, directory.parent / "tiny-draft.gguf")


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, draft_path: Path, module_live_server: Any) -> Any:
    settings = ServeSettings(
        speculate="draft", draft_model_id="tiny-draft", draft_model_path=str(draft_path)
    )
    return module_live_server(build_serving(smollm2, settings, batch=4, max_queue=8))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def openai_client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_the_answer_with_a_draft_model_is_the_models_own_and_usage_counts_the_guesses(
    server: Any,
) -> None:
    client = openai_client(server)
    guessed = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=40
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=40, extra_body={"speculate": False}
    )
    assert guessed.choices[0].message.content == plain.choices[0].message.content
    assert guessed.usage is not None and guessed.usage.completion_tokens_details is not None
    details = guessed.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens or 0) + (details.rejected_prediction_tokens or 0) > 0
    stats = httpx.get(f"{server.base_url}/stats", timeout=30).json()["speculation"]
    assert stats["mode"] == "draft"
    assert stats["draft_model"] == "tiny-draft"
    assert stats["draft_model_tokens"] > 0
    assert stats["draft_model_forwards"] > 0


def test_metrics_count_the_draft_models_guesses_and_forwards(server: Any) -> None:
    openai_client(server).chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=20
    )
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == MODEL
    }
    assert samples["modelhost_spec_draft_model_tokens_total"] > 0
    assert samples["modelhost_spec_draft_model_forwards_total"] > 0
    assert (
        samples["modelhost_spec_draft_model_accepted_tokens_total"]
        <= samples["modelhost_spec_draft_model_tokens_total"]
    )


def test_responses_and_anthropic_usage_carry_the_guess_counts(server: Any) -> None:
    response = openai_client(server).responses.create(
        model=MODEL, input="Write two sentences about the sea.", temperature=0,
        max_output_tokens=20,
    )  # fmt: skip
    assert response.usage is not None
    details = response.usage.output_tokens_details.model_dump()
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=MODEL, max_tokens=20,
        messages=[{"role": "user", "content": "Write two sentences about the sea."}],
    )  # fmt: skip
    extra = message.usage.model_dump()["output_tokens_details"]
    assert extra["accepted_prediction_tokens"] + extra["rejected_prediction_tokens"] > 0


def test_a_draft_model_with_another_tokenizer_is_refused_when_the_model_loads(
    smollm2: LoadedModel,
) -> None:
    gemma = EMBEDDED["gemma-3-270m"]()
    settings = ServeSettings(draft_model_id="gemma-3-270m", draft_model_path=str(gemma))
    with pytest.raises(DraftMismatch, match="tokenizers differ"):
        build_serving(smollm2, settings)


def test_speculate_draft_without_a_draft_model_is_refused_before_serving(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_serve.run_serve(parse("--in-process", "--speculate", "draft")) == 2
    assert "--speculate draft needs --draft-model" in capsys.readouterr().err


def test_a_draft_model_that_is_not_a_local_model_is_refused_before_serving(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_serve.run_serve(parse("--in-process", "--draft-model", "no-such-model")) == 2
    assert "draft model 'no-such-model' not found" in capsys.readouterr().err
