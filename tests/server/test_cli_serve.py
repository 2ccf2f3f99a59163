"""`modelhost serve`: its flags, their defaults, and a budget that cannot hold the model."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from scripted_engine import scripted_model

from modelhost import assembly, serve_config
from modelhost.cli import serve as cli_serve
from modelhost.cli import serve_args as cli_serve_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_binds_loopback_on_8080_with_batch_8_and_queue_64_by_default() -> None:
    args = parse()
    assert (args.models, args.host, args.port) == ([], "127.0.0.1", 8080)
    assert (args.model_budget, args.hold) == (None, 5.0)
    assert (args.batch, args.max_queue, args.memory_budget) == (8, 64, None)
    assert args.heartbeat == 15.0
    assert args.workers is True  # each model in its own worker process


def test_in_process_serves_models_in_the_serving_process() -> None:
    assert parse("--in-process").workers is False


def test_serve_flags_become_the_servers_settings() -> None:
    args = parse(
        "my-model",
        *("--memory-budget", "1.5", "--max-tokens", "64", "--temp", "0.2"),
        *("--top-p", "0.9", "--top-k", "5", "--context-length", "512", "--heartbeat", "3"),
        *("--prompt-threads", "3"),
    )
    settings = serve_config.settings_from_args(args)
    assert args.models == ["my-model"]
    assert settings.memory_budget_gb == 1.5
    assert settings.context_length == 512
    assert settings.heartbeat_s == 3.0
    assert settings.prompt_threads == 3
    defaults = settings.defaults
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.top_k) == (
        64,
        0.2,
        0.9,
        5,
    )


def test_context_overflow_is_error_unless_told_truncate_and_reaches_the_worker() -> None:
    assert serve_config.settings_from_args(parse()).context_overflow == "error"
    settings = serve_config.settings_from_args(parse("--context-overflow", "truncate"))
    worker = serve_config.WorkerConfig.from_json(serve_config.WorkerConfig(settings).to_json())
    assert worker.settings.context_overflow == "truncate"
    policy = assembly.admission_policy(scripted_model(), worker.settings, rows=1)
    assert policy.overflow == "truncate"


def test_the_body_cap_is_32_mib_unless_max_body_mb_says_otherwise() -> None:
    assert serve_config.settings_from_args(parse()).max_body_bytes == 32 * 1024 * 1024
    assert (
        serve_config.settings_from_args(parse("--max-body-mb", "0.5")).max_body_bytes == 512 * 1024
    )


def test_the_command_line_parses_without_importing_pytorch_or_the_server() -> None:
    # `modelhost bench` and `modelhost jobs` are clients: they start in a fraction of a second.
    code = """
import contextlib, io, sys
from modelhost.cli.main import main
for command in ("bench", "jobs"):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        main([command, "--help"])
print(sorted(m for m in ("torch", "starlette", "modelhost.cli.serve") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_imports_no_other_commands_machinery_before_serve_forks() -> None:
    # `modelhost serve` starts its fork server (which imports PyTorch, a second on a small
    # machine) right after parsing: the clients' and caches' modules must not come first.
    code = """
import sys
import modelhost.cli.main
heavy = ("httpx", "modelhost.bench", "modelhost.residency.kv.kv_store")
heavy += ("modelhost.inference.admission",)
print(sorted(m for m in heavy if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_serve_in_process_refuses_a_memory_budget_below_the_weights_before_it_listens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from modelhost.models.loading import loader

    monkeypatch.setattr(loader, "load_model", lambda name=None, **options: scripted_model())
    monkeypatch.setattr(assembly, "serve", lambda *a, **k: pytest.fail("must not serve"))
    assert cli_serve.run_serve(parse("--in-process", "--memory-budget", "0.001")) == 2
    assert "cannot hold the weights" in capsys.readouterr().err


def test_serve_holds_an_idle_models_whole_kv_cache_for_its_kv_hold_and_at_least_its_hold(
    smollm2,
) -> None:
    # An idle engine keeps its whole KV pool for --kv-hold (five minutes unless the budget
    # needs the room), and at least as long as --hold keeps the model from eviction: an
    # agent's next turn finds its prompt in memory (engine.py's idle_hold_s).
    assert serve_config.settings_from_args(parse()).kv_hold_s == 300.0
    assert serve_config.settings_from_args(parse("--kv-hold", "0")).kv_hold_s == 5.0
    settings = serve_config.settings_from_args(parse("--kv-hold", "1", "--hold", "12.5"))
    told = serve_config.WorkerConfig.from_json(serve_config.WorkerConfig(settings).to_json())
    stage = assembly.build_stage(smollm2, told.settings, batch=1)
    try:
        assert stage.engine.config.idle_hold_s == 12.5
    finally:
        stage.engine.close()
