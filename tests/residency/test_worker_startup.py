"""Where a worker's start went: the phases between the moments the worker and its parent noted."""

from __future__ import annotations

import json

from modelhost.residency.workers.worker_startup import StartupMarks, startup_phases


def test_the_phases_are_the_times_between_the_worker_and_parent_moments(tmp_path):
    path = tmp_path / "startup.json"
    path.write_text(json.dumps({"main": 10.5, "imported": 12.0, "loaded": 13.0, "engine": 13.25}))
    parent = {"asked": 10.0, "spawned": 10.25, "healthy": 13.5}
    assert startup_phases(path, parent) == {
        "spare_wait_ms": 250.0, "python_ms": 250.0, "imports_ms": 1500.0,
        "weights_ms": 1000.0, "engine_ms": 250.0, "listen_ms": 250.0,
    }  # fmt: skip


def test_a_phase_never_reads_below_zero(tmp_path):
    path = tmp_path / "startup.json"
    path.write_text(json.dumps({"main": 9.999}))
    assert startup_phases(path, {"spawned": 10.0})["python_ms"] == 0.0


def test_a_worker_that_wrote_nothing_or_garbage_leaves_only_the_parents_phases(tmp_path):
    parent = {"asked": 1.0, "spawned": 2.0, "healthy": 3.0}
    assert startup_phases(tmp_path / "missing.json", parent) == {"spare_wait_ms": 1000.0}
    (tmp_path / "torn.json").write_text('{"main": 1')
    assert startup_phases(tmp_path / "torn.json", parent) == {"spare_wait_ms": 1000.0}


def test_the_worker_writes_each_moment_as_it_passes_it(tmp_path):
    marks = StartupMarks(tmp_path / "startup.json")
    marks.mark("main")
    marks.mark("imported")
    written = json.loads((tmp_path / "startup.json").read_text())
    assert list(written) == ["main", "imported"]
    assert written["main"] <= written["imported"]
