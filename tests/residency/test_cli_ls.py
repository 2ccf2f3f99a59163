"""`modelhost ls`: one line per local model with its size, estimate, fit and residency."""

from __future__ import annotations

import gguf
import pytest
from gguf import GGMLQuantizationType
from synthetic_files import retype_tensor, write_tiny
from tiny_models import make_tiny_checkpoint

from modelhost.cli.main import main


def test_ls_prints_each_local_model_with_its_estimate_and_whether_it_fits(
    smollm2, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tiny_checkpoint(tmp_path / "tiny-a", "llama", smollm2)
    argv = ["ls", str(tmp_path / "tiny-a"), "--model-budget", "0.3", "--url", "http://127.0.0.1:9"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header = ["ID", "FORMAT", "ARCH", "SUPPORTED", "VISION", "SIZE", "WEIGHTS", "ESTIMATE"]
    header += ["PACKED", "KV-STORE", "WINDOW", "FITS", "RESIDENT"]
    assert lines[0].split() == header
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    assert rows["tiny-a"][1:5] == ["safetensors", "llama", "yes", "no"]
    assert rows["tiny-a"][-2:] == ["yes", "-"]  # no server answered: residency unknown
    # 0.13 GB held idle and 0.36 GB a request may claim (working memory, a context of KV)
    # against a 0.3 GB budget: served alone, when it comes to that
    assert rows["smollm2-135m-instruct"][-2:] == ["alone", "-"]
    assert "no server answered" in lines[-1]


def test_ls_lists_a_model_it_cannot_serve_as_refused_and_says_why(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny(tmp_path / "tiny-iq.gguf", "Q4_0")
    retype_tensor(path, "blk.1.ffn_up.weight", GGMLQuantizationType.IQ4_NL)
    assert main(["ls", str(path), "--url", "http://127.0.0.1:9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[1 : lines.index("")]
    rows = {line.split()[0]: line.split() for line in table}
    assert rows["tiny-iq"][-2] == "refused"
    assert "tiny-iq cannot be served: tensor blk.1.ffn_up.weight is IQ4_NL" in "\n".join(lines)


def test_ls_says_on_which_cluster_nodes_each_model_is_resident(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from live_server import LiveServer
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    rows = [
        {"id": "smollm2-135m-instruct", "resident": True, "nodes": ["10.0.0.1/aa", "10.0.0.2/bb"]},
        {"id": "far-away", "resident": True, "nodes": ["10.0.0.2/bb"], "format": "gguf"},
        {"id": "gemma-3-270m", "resident": False},
    ]
    listing = Route("/v1/models", lambda request: JSONResponse({"data": rows}))
    with LiveServer(Starlette(routes=[listing])) as front:
        assert main(["ls", str(tmp_path), "--url", front.base_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line for line in lines[1:] if line.strip()}
    assert table["smollm2-135m-instruct"].endswith("yes: 10.0.0.1/aa, 10.0.0.2/bb")
    assert table["gemma-3-270m"].endswith("no")
    assert table["far-away"].split()[1] == "gguf"  # on another node's disk only
    assert table["far-away"].endswith("yes: 10.0.0.2/bb")


def _projector(path, kind: str):
    """An mmproj header saying which projector it holds (ls reads no tensors)."""
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_projector_type(kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_ls_says_which_models_read_images(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF with a vision projector we compute beside it reads images; one alone, or beside a
    projector we do not compute, does not; the projector is part of its model, not a model."""
    (tmp_path / "pair").mkdir()
    write_tiny(tmp_path / "pair" / "tiny-gemma3-vl.gguf", "Q4_0")
    _projector(tmp_path / "pair" / "mmproj-tiny-gemma3-vl.gguf", "gemma3")
    (tmp_path / "other").mkdir()
    write_tiny(tmp_path / "other" / "tiny-other-vl.gguf", "Q4_0")
    _projector(tmp_path / "other" / "mmproj-tiny-other-vl.gguf", "llama4")
    write_tiny(tmp_path / "tiny-text.gguf", "Q4_0")
    paths = [str(tmp_path / "pair"), str(tmp_path / "other"), str(tmp_path / "tiny-text.gguf")]
    assert main(["ls", *paths, "--url", "http://127.0.0.1:9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    vision = lines[0].split().index("VISION")
    rows = {line.split()[0]: line.split() for line in lines[1 : lines.index("")]}
    assert rows["tiny-gemma3-vl"][vision] == "yes"
    assert rows["tiny-other-vl"][vision] == "no"
    assert rows["tiny-text"][vision] == "no"
    assert not any(name.startswith("mmproj") for name in rows)
