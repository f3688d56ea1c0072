"""The blocking API: Tally (one per process, shared by its threads) and Run."""

import time
import urllib.parse

from . import _requests, _wire
from ._transport import Transport


class Tally:
    """A connection to tally for one agent process.

    Publishes to `<topic_prefix>intents` and reads its answers on a reply topic of its own
    (`<topic_prefix>replies.<agent>.<random>`, created now and deleted by close()), so the
    process reads only its own answers. With `reply_topic` (and optionally
    `reply_partition`) it uses that topic instead, read from its end; answers are told apart
    by correlation id. `reply_prefix` is the deployment's TALLY_REPLY_TOPIC_PREFIX (default
    `<topic_prefix>replies.`). `config`: more librdkafka settings for every client (security,
    client.id, ...). `source`: the CloudEvents source (default `/agents/<agent>`).

    Thread-safe: one Tally can serve every thread of the process.
    """

    def __init__(self, brokers, agent, *, topic_prefix="tally.", reply_topic=None,
                 reply_partition=None, reply_prefix=None, config=None, source=None):
        self.agent = agent
        self.source = source or "/agents/" + urllib.parse.quote(agent, safe="")
        self._transport = Transport(brokers, agent, topic_prefix=topic_prefix,
                                    reply_topic=reply_topic, reply_partition=reply_partition,
                                    reply_prefix=reply_prefix, config=config)
        self._transport.start()

    @property
    def reply_topic(self):
        return self._transport.reply_topic

    def run(self, run_id, tenant=None):
        """A handle on run `run_id` (your task's id; the Kafka key of its messages)."""
        return Run(self, _requests.check_run_id(run_id), tenant)

    def stats(self):
        """Counters of this client: published, messages_read (everything the reply consumer
        read), answers (new answers handed to a waiting call), duplicates (the same answer
        again), late (answers to calls that are over), foreign (another process's answers
        on a shared reply topic), unreadable."""
        return self._transport.stats()

    def close(self):
        self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _exchange(self, request, timeout):
        """Publish request.event and wait for the answer that ends it (or the timeout)."""
        transport = self._transport
        if transport.refusal is not None:
            raise _requests.local_refusal(transport)
        deadline = time.monotonic() + timeout
        corr = _wire.new_correlation_id()
        box = transport.open(corr)
        try:
            delivery = transport.publish(request.event, corr)
            delivery.done.wait(transport.delivery_timeout)
            error = transport.delivery_error(request.event, delivery)
            if error is not None:
                raise error
            index, answers = self._wait(box, request.settles, deadline)
        finally:
            transport.discard(box)
        return request.finish(answers, index, timeout)

    def _wait(self, box, settles, deadline):
        cond = self._transport.cond
        checked = 0
        with cond:
            while True:
                self._transport.check()
                index = _requests.first_settling(box.answers, checked, settles)
                if index is not None:
                    return index, list(box.answers)
                checked = len(box.answers)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, list(box.answers)
                cond.wait(left)


class Run:
    """One run (an agent's task): its steps, and how it ends."""

    def __init__(self, tally, run_id, tenant=None):
        self.tally = tally
        self.run_id = run_id
        self.tenant = tenant

    def call(self, step, tool, args, *, timeout=30.0, first=False, operation_key=None,
             traceparent=None):
        """Publish a tally.intent.v1 and return its final answer as an Outcome.

        Waits through UNKNOWN, AWAITING_APPROVAL, STUCK, PLANNED and DISPATCHING; returns on
        CONFIRMED (and DUPLICATE, COMPENSATED); raises EffectFailed, EffectConflict,
        EffectRejected, EffectCancelled, IntentRefused, or OutcomeTimeout (with the last
        answer seen). first=True returns the first answer, whatever it says, without raising
        on it. Publishing the same step again (after a crash) answers with the same effect.
        """
        request = _requests.call(self.tally.source, self.run_id, self.tenant, step, tool, args,
                                 first=first, operation_key=operation_key,
                                 traceparent=traceparent)
        return self.tally._exchange(request, timeout)

    def compensate(self, reason, *, timeout=60.0):
        """tally.compensate_run.v1: undo the run, last step first. Returns the RunSummary of
        tally.run.compensated.v1 (COMPENSATED, PARTIALLY_COMPENSATED) or tally.run.stuck.v1
        (a human must finish it)."""
        return self.tally._exchange(
            _requests.compensate(self.tally.source, self.run_id, reason), timeout)

    def cancel(self, reason, *, compensate=False, timeout=60.0):
        """tally.cancel_run.v1: effects not yet dispatched are CANCELLED. Returns the
        RunSummary of tally.run.cancelled.v1, or with compensate=True the compensation's."""
        return self.tally._exchange(
            _requests.cancel(self.tally.source, self.run_id, reason, compensate), timeout)

    def complete(self, reason=None, *, timeout=60.0):
        """tally.complete_run.v1: the run is done; later intents for it are refused
        (run_not_active). Returns the RunSummary of tally.run.completed.v1, sent once no
        effect of the run is in flight."""
        return self.tally._exchange(
            _requests.complete(self.tally.source, self.run_id, reason), timeout)
