"""The asyncio API: the same as the blocking one, as coroutines.

    async with AsyncTally("127.0.0.1:9092", agent="billing-bot") as tally:
        outcome = await tally.run("run-42").call(1, "charge_card", {...})

The Kafka clients run on the same background threads as Tally's; answers and delivery
reports reach the event loop with call_soon_threadsafe, so nothing here blocks the loop
(start and close run in the default executor).
"""

import asyncio
import time
import urllib.parse

from . import _requests, _wire
from ._transport import Transport


class AsyncTally:
    """Tally for asyncio; the arguments are Tally's. Use `async with`, or await start() and
    close() yourself."""

    def __init__(self, brokers, agent, *, topic_prefix="tally.", reply_topic=None,
                 reply_partition=None, reply_prefix=None, config=None, source=None):
        self.agent = agent
        self.source = source or "/agents/" + urllib.parse.quote(agent, safe="")
        self._transport = Transport(brokers, agent, topic_prefix=topic_prefix,
                                    reply_topic=reply_topic, reply_partition=reply_partition,
                                    reply_prefix=reply_prefix, config=config)

    @property
    def reply_topic(self):
        return self._transport.reply_topic

    async def start(self):
        await asyncio.get_running_loop().run_in_executor(None, self._transport.start)
        return self

    async def close(self):
        await asyncio.get_running_loop().run_in_executor(None, self._transport.close)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.close()

    def run(self, run_id, tenant=None):
        return AsyncRun(self, _requests.check_run_id(run_id), tenant)

    def stats(self):
        """As Tally.stats()."""
        return self._transport.stats()

    async def _exchange(self, request, timeout):
        transport = self._transport
        if transport.refusal is not None:
            raise _requests.local_refusal(transport)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        woken = asyncio.Event()

        def wake():  # from the consumer's thread
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        reported = loop.create_future()

        def on_delivery(_delivery):  # from the producer's thread
            try:
                loop.call_soon_threadsafe(_resolve, reported)
            except RuntimeError:
                pass

        corr = _wire.new_correlation_id()
        box = transport.open(corr, wake)
        try:
            delivery = transport.publish(request.event, corr, on_delivery)
            try:
                await asyncio.wait_for(reported, transport.delivery_timeout)
            except asyncio.TimeoutError:
                pass
            error = transport.delivery_error(request.event, delivery)
            if error is not None:
                raise error
            checked, index = 0, None
            while True:
                woken.clear()
                answers = transport.snapshot(box)
                index = _requests.first_settling(answers, checked, request.settles)
                checked = len(answers)
                left = deadline - time.monotonic()
                if index is not None or left <= 0:
                    break
                try:
                    await asyncio.wait_for(woken.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            transport.discard(box)
        return request.finish(answers, index, timeout)


def _resolve(future):
    if not future.done():
        future.set_result(None)


class AsyncRun:
    """Run, with coroutines."""

    def __init__(self, tally, run_id, tenant=None):
        self.tally = tally
        self.run_id = run_id
        self.tenant = tenant

    async def call(self, step, tool, args, *, timeout=30.0, first=False, operation_key=None,
                   traceparent=None):
        """As Run.call()."""
        request = _requests.call(self.tally.source, self.run_id, self.tenant, step, tool, args,
                                 first=first, operation_key=operation_key,
                                 traceparent=traceparent)
        return await self.tally._exchange(request, timeout)

    async def compensate(self, reason, *, timeout=60.0):
        """As Run.compensate()."""
        return await self.tally._exchange(
            _requests.compensate(self.tally.source, self.run_id, reason), timeout)

    async def cancel(self, reason, *, compensate=False, timeout=60.0):
        """As Run.cancel()."""
        return await self.tally._exchange(
            _requests.cancel(self.tally.source, self.run_id, reason, compensate), timeout)

    async def complete(self, reason=None, *, timeout=60.0):
        """As Run.complete()."""
        return await self.tally._exchange(
            _requests.complete(self.tally.source, self.run_id, reason), timeout)
