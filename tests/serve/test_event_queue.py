"""The event queue between the engine thread and the event loop: events in order, one wake-up
for the events put while one is pending, and a close that ends the reader."""

from __future__ import annotations

import asyncio
import threading

from kvforge.runners.serve.app import EventQueue
from kvforge.runners.serve.scheduler import Delta, Event, Finished


def deltas(count: int) -> list[Event]:
    return [Delta(str(i), (), 0) for i in range(count)]


def test_events_put_from_another_thread_arrive_in_order_with_one_wake_up_per_batch() -> None:
    async def run() -> tuple[list[Event | None], int, bool]:
        loop = asyncio.get_running_loop()
        events = EventQueue(loop)
        wakes = 0
        wake = events._wake

        def counted() -> None:
            nonlocal wakes
            wakes += 1
            wake()

        events._wake = counted  # type: ignore[method-assign]
        sent = deltas(5)
        putter = threading.Thread(target=lambda: [events.put(event) for event in sent])
        putter.start()
        putter.join()  # the loop has not run since: all five wait behind one wake-up
        ready = events.ready()
        got = [await events.next() for _ in sent]
        await asyncio.sleep(0.01)  # the pending wake-up has run by now
        return got, wakes, ready

    got, wakes, ready = asyncio.run(run())
    assert [event.text for event in got if isinstance(event, Delta)] == ["0", "1", "2", "3", "4"]
    assert wakes == 1 and ready


def test_a_reader_waiting_is_woken_by_a_put_and_ended_by_close() -> None:
    async def run() -> tuple[Event | None, Event | None]:
        loop = asyncio.get_running_loop()
        events = EventQueue(loop)
        finished = Finished("stop", 3, 1)
        loop.call_later(0.01, lambda: threading.Thread(target=events.put, args=(finished,)).start())
        first = await asyncio.wait_for(events.next(), 5)
        loop.call_later(0.01, events.close)
        after_close = await asyncio.wait_for(events.next(), 5)
        return first, after_close

    first, after_close = asyncio.run(run())
    assert isinstance(first, Finished) and first.reason == "stop"
    assert after_close is None
