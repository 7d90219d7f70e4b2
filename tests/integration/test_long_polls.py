"""`Waiter.until_changed` on real Redis: without `reread_at_timeout` (the agents' work long-poll)
a long-poll that times out with no wake-up returns what it read first without reading again; a
wake-up makes it read again and answer; by default a timeout reads again."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from server.wakeups import Publisher, Waiter


def test_a_quiet_timeout_answers_the_first_read_and_a_wake_up_reads_again(clean_redis: str) -> None:
    async def story() -> None:
        waiter = Waiter(clean_redis)
        await waiter.start()
        reads: list[int] = []
        version = {"now": 1}

        def load() -> int:
            reads.append(version["now"])
            return version["now"]

        try:
            began = time.monotonic()
            value = await waiter.until_changed("agent:1", load, lambda v: v != 1, 0.5, reread_at_timeout=False)
            assert value == 1 and reads == [1], "nothing woke the channel: one read, at the start"
            assert time.monotonic() - began >= 0.5
            reads.clear()
            value = await waiter.until_changed("agent:1", load, lambda v: v != 1, 0.3)
            assert reads == [1, 1], "by default a timeout reads again: a lost wake-up is caught there"

            async def change_soon() -> None:
                await asyncio.sleep(0.2)
                version["now"] = 2
                Publisher(clean_redis).publish(["agent:1"])

            reads.clear()
            changer = asyncio.create_task(change_soon())
            value = await waiter.until_changed("agent:1", load, lambda v: v != 1, 10, reread_at_timeout=False)
            await changer
            assert value == 2 and reads == [1, 2]
        finally:
            await waiter.stop()

    # A thread of its own: an earlier test in this process may have left an event loop set as
    # running in the main thread, where asyncio.run refuses to start.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, story()).result(timeout=60)
