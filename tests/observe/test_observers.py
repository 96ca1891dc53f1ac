"""Observers (followers, egress run's reports) cannot stall the proxy; the audit log loses nothing.

Before: RunState.publish put() into a follower's queue of 10000 and blocked once it was
full, on the event loop; after ~10k refusals with one `egress events --follow` that
stopped reading, the proxy answered nobody.
"""

from __future__ import annotations

import asyncio
import io
import threading

import pytest
from prometheus_client import generate_latest

from egress.core.reasons import Verdict
from egress.host.control import RunState
from egress.observe import events
from egress.observe.events import Event, Recorder
from egress.observe.metrics import Metrics


def event(i: int) -> Event:
    return Event(client="127.0.0.1:1", method="GET", host=f"h{i}.test", port=80, decision="block",
                 reason="not-allowed")


def test_a_stuck_subscriber_loses_events_counted_and_the_audit_log_none():
    metrics, audit = Metrics(), io.StringIO()
    recorder = Recorder(metrics, audit)
    release = threading.Event()
    got = []
    observer = recorder.subscribe(lambda e: (got.append(e), release.wait()), name="stuck", limit=100)
    for i in range(5000):
        recorder.record(event(i))  # returns whatever the subscriber does
    dropped = metrics.events_dropped.labels("stuck")._value.get()
    assert dropped == observer.dropped and 5000 - 101 <= dropped <= 5000 - 100
    assert len(audit.getvalue().splitlines()) == 5000
    release.set()
    recorder.close()
    assert len(got) == 5000 - dropped


def test_a_follower_that_stopped_reading_never_blocks_publish():
    state = RunState("r", ["x"])
    drops = []
    state.on_drop = lambda: drops.append(1)
    state.follow(limit=100)  # never read
    done = threading.Event()

    def publish():
        for i in range(1000):
            state.publish(event(i))
        done.set()

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    thread.join(60)  # a blocking publish would still be stuck at event 101
    assert done.is_set()
    assert state.dropped == 900 and len(drops) == 900


def test_close_delivers_what_is_queued():
    recorder = Recorder(Metrics())
    got = []
    recorder.subscribe(got.append, name="run")
    for i in range(300):
        recorder.record(event(i))
    recorder.close()
    assert [e.host for e in got] == [f"h{i}.test" for i in range(300)]


# ------------------------------------- a run's reporter: refusals are answered after its line


def test_a_refusal_waits_for_the_runs_line_and_an_allowed_request_for_nothing():
    async def scenario():
        recorder = Recorder(Metrics())
        release, written = threading.Event(), []
        recorder.subscribe(lambda e: (release.wait(10), written.append(e.host)), name="run", heard=True)
        assert recorder.record(Event("c", "GET", "ok.test", 80, "allow", "allowed")) is None
        telling = recorder.record(event(1))
        assert telling is not None and telling.pending()
        await asyncio.sleep(0.05)
        assert telling.pending() and "h1.test" not in written  # the line is not written yet
        release.set()
        await telling.wait()
        assert written == ["ok.test", "h1.test"]
        error = recorder.record(Event("c", "GET", "up.test", 80, "error", "upstream-refused"))
        assert error is not None  # an upstream failure's line too
        await error.wait()
        recorder.close()

    asyncio.run(scenario())


def test_a_reporter_that_cannot_write_holds_one_answer_for_heard_wait_then_none_until_it_catches_up(monkeypatch):
    monkeypatch.setattr(events, "HEARD_WAIT", 0.2)

    async def scenario():
        recorder = Recorder(Metrics())
        release = threading.Event()
        recorder.subscribe(lambda e: release.wait(10), name="run", heard=True)
        first = recorder.record(event(1))
        await first.wait()  # gives up after HEARD_WAIT: the answer goes anyway
        assert first.pending() and recorder.reporter.stalled
        assert recorder.record(event(2)) is None  # no more waiting on a reporter that is stuck
        release.set()
        for _ in range(100):  # it writes what was queued, and is waited for again
            if not recorder.reporter.stalled:
                break
            await asyncio.sleep(0.02)
        third = recorder.record(event(3))
        assert third is not None
        await third.wait()
        assert not third.pending()
        recorder.close()

    asyncio.run(scenario())


def test_no_answer_waits_outside_an_event_loop_or_without_a_reporter():
    recorder = Recorder(Metrics())
    assert recorder.record(event(1)) is None  # no reporter
    recorder.subscribe(lambda e: None, name="run", heard=True)
    assert recorder.record(event(2)) is None  # no event loop: no client to hold
    with pytest.raises(ValueError):
        recorder.subscribe(lambda e: None, name="run2", heard=True)
    recorder.close()


def test_the_verdicts_are_written_as_the_words_they_always_were():
    typed = Event(client="c", method="GET", host="h.test", port=80, decision=Verdict.BLOCK, reason="denied")
    plain = Event(client="c", method="GET", host="h.test", port=80, decision="block", reason="denied")
    assert typed.to_json() == plain.to_json() and '"decision":"block"' in typed.to_json()
    metrics = Metrics()
    Recorder(metrics).record(typed)
    assert b'egress_requests_total{decision="block",reason="denied"} 1.0' in generate_latest(metrics.registry)


def test_an_observer_is_any_callable_of_one_event():
    got: list = []

    class Lines:  # an observer of its own kind, as serve's log lines are
        def __call__(self, event: Event) -> None:
            got.append(event.host)

    observer: events.Observer = Lines()
    recorder = Recorder(Metrics())
    recorder.subscribe(observer, name="lines")
    recorder.record(event(1))
    recorder.close()
    assert got == ["h1.test"]
