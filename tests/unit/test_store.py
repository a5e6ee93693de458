"""launcher/rank/store.py: the job's key-value store, on a real TCPStore on this machine.
Restarted groups end to end: tests/e2e/test_reliability.py."""

from __future__ import annotations


def test_each_attempt_of_a_restarted_group_has_a_namespace_of_its_own(monkeypatch):
    """store.job_store: keys a dead attempt left in torchrun's store (a peer's address) are
    not seen by the next attempt, which a real store on this machine shows."""
    import socket

    from launcher.rank.store import job_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    host = job_store(rank=0, world_size=2, timeout_s=10)  # rank 0 hosts it, as without torchrun
    host.set("peer/1", "node-a.invalid:1234")
    assert job_store(rank=None, world_size=2, timeout_s=10).check(["peer/1"])  # the same attempt sees it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = job_store(rank=None, world_size=2, timeout_s=10)
    assert not again.check(["peer/1"])
    again.set("peer/1", "127.0.0.1:5678")
    assert host.get("peer/1") == b"node-a.invalid:1234"  # the old attempt's key is its own
