"""Per-hop timestamps: off by default, one line per (request, hop) when on, whole lines across threads."""

from __future__ import annotations

import os
import threading

from pagefleet.worker.replica import hop_trace


def test_off_unless_the_variable_names_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hop_trace, "PATH", None)
    hop_trace.mark("r-off", "engine_added")
    assert list(tmp_path.iterdir()) == []


def test_each_hop_of_a_request_is_written_once_as_a_whole_line(tmp_path, monkeypatch):
    path = tmp_path / "hops.txt"
    monkeypatch.setattr(hop_trace, "PATH", str(path))
    monkeypatch.setattr(hop_trace, "_fd", None)
    monkeypatch.setattr(hop_trace, "_seen", set())
    hop_trace.mark("r1", "ingress_http", 1700000000.25)
    hop_trace.mark("r1", "ingress_http", 1700000009.0)  # a second passage is not a new hop

    def many(tag: str) -> None:
        for i in range(200):
            hop_trace.mark(f"{tag}-{i}", "engine_first_token")

    threads = [threading.Thread(target=many, args=(t,)) for t in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text().splitlines()
    assert lines[0] == "r1 ingress_http 1700000000.250000"
    assert len(lines) == 1 + 600
    assert {tuple(line.split()[:2]) for line in lines[1:]} == {(f"{t}-{i}", "engine_first_token")
                                                               for t in "abc" for i in range(200)}
    assert all(len(line.split()) == 3 for line in lines)
    os.close(hop_trace._fd)
