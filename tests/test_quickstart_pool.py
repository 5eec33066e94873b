"""The quickstart's pool forks its workers only where that is safe: no thread started since torch's import.

That the command's own workers are forked (and still end at a failure) is checked through the user's path in
tests/cli/test_quickstart.py; here, the two things that must rule fork out."""

from __future__ import annotations

import threading

from vitconvert.quickstart import pool


def test_a_running_python_thread_rules_out_fork():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert pool.start_method() == "spawn"
    finally:
        stop.set()
        thread.join()


def test_a_native_thread_started_after_import_rules_out_fork(monkeypatch):
    """An OpenMP pool left by a torch op on several threads shows as native threads the import did not leave."""
    native_now = pool.os_threads() - threading.active_count()
    monkeypatch.setattr(pool, "NATIVE_AFTER_IMPORT", native_now - 1)
    assert pool.start_method() == "spawn"
