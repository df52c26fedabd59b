"""The engine-to-event-loop bridge: order kept, one loop wake-up per burst of chunks."""

from __future__ import annotations

import asyncio

from turbospark.server.bridge import LoopBridge


def test_a_burst_of_chunks_wakes_the_loop_once_and_keeps_order():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakes = []
        real = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakes.append(callback)
            return real(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        bridge = LoopBridge(loop)
        queues: list[asyncio.Queue[int]] = [asyncio.Queue(), asyncio.Queue()]
        for i in range(6):  # one engine step of six rows, before the loop runs again
            bridge.put(queues[i % 2], i)
        got = [[await queue.get() for _ in range(3)] for queue in queues]
        assert got == [[0, 2, 4], [1, 3, 5]]
        assert len(wakes) == 1
        bridge.put(queues[0], 6)  # the next step wakes it again
        assert await queues[0].get() == 6 and len(wakes) == 2

    asyncio.run(main())


def test_chunks_from_another_thread_arrive_in_order():
    async def main() -> None:
        bridge = LoopBridge(asyncio.get_running_loop())
        queue: asyncio.Queue[int] = asyncio.Queue()
        await asyncio.to_thread(lambda: [bridge.put(queue, i) for i in range(200)])
        assert [await queue.get() for _ in range(200)] == list(range(200))

    asyncio.run(main())
