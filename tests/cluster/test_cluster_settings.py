"""What `--cluster` adds without starting a cluster: single-machine serving never imports Ray,
the cluster's flags refuse what they cannot use, and so does `--cluster` itself (a draft model,
which no node would hold)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from modelhost.cli import serve as cli_serve
from modelhost.cli import serve_args as cli_serve_args
from modelhost.serve_config import parse_replicas
from modelhost.server.edge.cluster_secret import read_token_file

SINGLE_MACHINE_IMPORTS = """
import sys
import modelhost.cli.main, modelhost.cli.serve, modelhost.cli.worker, modelhost.cli.ls
import modelhost.server.app, modelhost.server.front.leasing, modelhost.server.front.worker_proxy
import modelhost.residency.cluster
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.startswith("ray"))
"""


def test_serving_on_one_machine_never_imports_ray():
    done = subprocess.run([sys.executable, "-c", SINGLE_MACHINE_IMPORTS], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_replicas_are_read_as_model_and_count():
    assert parse_replicas(["org/model=2", "tiny=1"]) == {"org/model": 2, "tiny": 1}
    for bad in ("tiny", "tiny=0", "=2", "tiny=two"):
        with pytest.raises(SystemExit, match="MODEL=N"):
            parse_replicas([bad])


def test_a_token_file_others_can_read_is_refused(tmp_path: Path):
    token = tmp_path / "token"
    token.write_text("s3cret-of-the-cluster-0123456789\n")
    token.chmod(0o644)
    with pytest.raises(SystemExit, match="chmod 600"):
        read_token_file(token)
    token.chmod(0o600)
    assert read_token_file(token) == "s3cret-of-the-cluster-0123456789"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="modelhost")
    cli_serve_args.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--draft-model", "smollm2-135m-instruct"),
            "--draft-model is not available with --cluster",
        ),
        (("--speculate", "draft"), "--speculate draft needs --draft-model"),
    ],
)
def test_a_draft_model_is_refused_with_cluster_before_joining_it(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
):
    # Nothing listens at this address: a refusal that came after joining would say so instead.
    assert cli_serve.run_serve(parse("--cluster", "127.0.0.1:9", *flags)) == 2
    assert message in capsys.readouterr().err
