"""`modelhost serve A B --model-budget GB`: the first model loads before listening and is current;
the others are known by id and load on demand, under the given budget."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from starlette.testclient import TestClient
from tiny_models import make_tiny_checkpoint

from modelhost import assembly
from modelhost.cli import serve as cli_serve
from modelhost.cli import serve_args as cli_serve_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_makes_the_first_model_current_and_knows_the_others_under_the_budget(
    smollm2, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_tiny_checkpoint(tmp_path / "tiny-a", "llama", smollm2)
    second = make_tiny_checkpoint(tmp_path / "tiny-b", "qwen2", smollm2)
    served: dict[str, Any] = {}
    monkeypatch.setattr(assembly, "serve", lambda app, **options: served.update(app=app) or True)
    args = parse(str(first), str(second), "--model-budget", "0.03", "--in-process")
    assert cli_serve.run_serve(args) == 0
    router = served["app"].state.router
    assert router.current == "tiny-a"
    assert router.host.budget_bytes == 30_000_000
    assert router.registry.get("tiny-b") is not None
    assert router.host.resident() == []  # the startup model is adopted when the app starts
    with TestClient(served["app"]) as client:
        assert [m.id for m in router.host.resident()] == ["tiny-a"]
        body = {"model": "tiny-b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.json()["model"] == "tiny-b"
        assert [m.id for m in router.host.resident()] == ["tiny-b"]  # 0.03 GB holds one
    assert router.host.resident() == []


def test_serve_refuses_a_model_it_cannot_find_before_it_listens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(assembly, "serve", lambda *a, **k: pytest.fail("must not serve"))
    assert cli_serve.run_serve(parse("no-such-model")) == 2
    assert "model 'no-such-model' not found" in capsys.readouterr().err
