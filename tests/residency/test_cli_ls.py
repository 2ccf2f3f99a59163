"""`modelhost ls`: one line per local model with its size, estimate, fit and residency."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_checkpoint

from modelhost.cli import main


def test_ls_prints_each_local_model_with_its_estimate_and_whether_it_fits(
    smollm2, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_checkpoint(tmp_path / "tiny-a", "llama", smollm2)
    argv = ["ls", str(tmp_path / "tiny-a"), "--model-budget", "0.5", "--url", "http://127.0.0.1:9"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "FORMAT", "ARCH", "SIZE", "ESTIMATE", "FITS", "RESIDENT"]
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    assert rows["tiny-a"][1:3] == ["safetensors", "llama"]
    assert rows["tiny-a"][-2:] == ["yes", "-"]  # no server answered: residency unknown
    assert rows["smollm2-135m-instruct"][-2:] == ["no", "-"]  # 1.8 GB estimate, 0.5 GB budget
    assert "no server answered" in lines[-1]
