"""``facecore.periodic.Periodic``: the calls go on through failures, logged once per run of them."""

from __future__ import annotations

import logging
import threading

import pytest

from facecore import periodic
from facecore.periodic import Periodic


def test_a_run_of_failures_is_logged_once_and_its_end_with_its_length(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    calls, errors, done = [0], [0], threading.Event()

    def action() -> None:  # fails 20 times, then works
        calls[0] += 1
        if calls[0] == 25:
            done.set()
        if 2 <= calls[0] <= 21:
            raise ConnectionRefusedError("the database is down")

    def on_error() -> None:
        errors[0] += 1

    caplog.set_level(logging.INFO, logger=periodic.__name__)
    repeated = Periodic("test-watch", action, "the watch failed", on_error)
    repeated.start(0.001)
    try:
        assert done.wait(10)
    finally:
        repeated.stop()
    records = [r for r in caplog.records if r.name == periodic.__name__]
    assert errors[0] == 20
    assert [(r.levelno, r.exc_info is not None) for r in records] == [(logging.ERROR, True),
                                                                       (logging.WARNING, False)]
    assert "(20 tries); working again" in records[1].getMessage()

    monkeypatch.setattr(periodic, "REMIND_S", 0.0)  # a reminder at every failure after the first
    caplog.clear()
    calls[0], done = 0, threading.Event()
    repeated.start(0.001)
    try:
        assert done.wait(10)
    finally:
        repeated.stop()
    reminders = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.exc_info is None]
    assert len(reminders) == 19 and "(20 tries); retrying: ConnectionRefusedError" in reminders[-1]
