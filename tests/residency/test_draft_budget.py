"""A model served with a draft model (`--draft-model`) is budgeted with the draft beside it:
what the unit holds idle and what its requests claim both count the draft's share."""

from __future__ import annotations

import argparse
from pathlib import Path

from modelhost.cli import serve as cli_serve
from modelhost.cli import serve_args as cli_serve_args
from modelhost.residency.registry import ModelRegistry, with_draft
from modelhost.residency.unit import claim_bytes
from modelhost.serve_config import settings_from_args

TARGET, DRAFT = "gemma-3-270m", "smollm2-135m-instruct"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def registry(tmp_path: Path) -> ModelRegistry:
    return ModelRegistry([], home=tmp_path / "home", hf_hub=tmp_path / "hub")


def test_a_model_with_a_draft_holds_and_claims_the_drafts_bytes_too(tmp_path: Path) -> None:
    models = registry(tmp_path)
    target, draft = models.get(TARGET), models.get(DRAFT)
    assert target is not None and draft is not None
    paired = with_draft(target, draft)
    assert paired.estimate_bytes == target.estimate_bytes + draft.estimate_bytes
    # Never less than the two claimed apart (the pools' ceilings add up: a bound, not a sum).
    assert claim_bytes(paired, 2) >= claim_bytes(target, 2) + claim_bytes(draft, 2)


def test_the_host_sees_every_model_but_the_draft_itself_with_the_draft_beside_it(
    tmp_path: Path,
) -> None:
    models = registry(tmp_path)
    args = parse("--draft-model", DRAFT)
    settings = cli_serve.with_draft_model(args, settings_from_args(args), models)
    assert settings.draft_model_id == DRAFT
    draft = models.get(DRAFT)
    target = models.get(TARGET)
    assert draft is not None and target is not None
    assert settings.draft_model_path == str(draft.path)
    seen = cli_serve.paired(models, draft, TARGET)
    assert seen is not None
    assert seen.estimate_bytes == target.estimate_bytes + draft.estimate_bytes
    assert cli_serve.paired(models, draft, DRAFT) == draft  # served on its own, alone
