"""One message to tally and what ends the wait for its answers: the part of a call that is
the same in the blocking API (client.py) and the asyncio one (aio.py)."""

from . import _wire
from .errors import IntentRefused, OutcomeTimeout, effect_error, refusal
from .outcome import Outcome, RunSummary, answer_from

# What each run message waits for (docs/agent-protocol.md, "Runs that finish").
_COMPENSATION_ENDS = frozenset({_wire.RUN_COMPENSATED, _wire.RUN_STUCK})


class Request:
    """An event to publish, `settles(answer)` (does this answer end the wait) and
    `finish(answers, index, timeout)` (the result, or the error to raise)."""

    def __init__(self, event, settles, finish):
        self.event = event
        self.settles = settles
        self.finish = finish


def check_run_id(run_id):
    if not isinstance(run_id, str) or not run_id:
        raise ValueError(f"run_id must be a non-empty string, not {run_id!r}")
    return run_id


def call(source, run_id, tenant, step, tool, args, *, first, operation_key, traceparent):
    """tally.intent.v1: the final answer (or the first with first=True) as an Outcome."""
    if isinstance(step, bool) or not isinstance(step, (int, str)):
        raise TypeError(f"step must be an int or a str, not {type(step).__name__}")
    if not isinstance(tool, str) or not tool:
        raise ValueError(f"tool must be a non-empty string, not {tool!r}")
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict (a JSON object), not {type(args).__name__}")
    event = _wire.intent_event(source, run_id, step, tool, args, tenant, operation_key,
                               traceparent)

    def settles(answer):
        return first or _wire.settles_call(answer)

    def finish(answers, index, timeout):
        seen = answers if index is None else answers[:index + 1]
        history = tuple(Outcome.from_event(a) for a in seen)
        if index is None:
            last = Outcome.from_event(seen[-1], history) if seen else None
            raise OutcomeTimeout(
                f"no {'' if first else 'final '}answer to step {step!r} ({tool}) of run "
                f"{run_id} within {timeout:g} s; last answer: "
                f"{last.status if last else 'none'}", last)
        outcome = Outcome.from_event(seen[index], history)
        if not first:
            error = effect_error(outcome)
            if error is not None:
                raise error
        return outcome

    return Request(event, settles, finish)


def run_message(source, run_id, type_, ends, *, reason=None, compensate=None):
    """compensate_run, cancel_run or complete_run: the RunSummary of the first answer whose
    type is in `ends`; a refusal raises IntentRefused."""
    event = _wire.run_event(type_, source, run_id, reason, compensate)

    def settles(answer):
        return answer.get("type") in ends or answer.get("type") == _wire.INTENT_REJECTED

    def finish(answers, index, timeout):
        seen = answers if index is None else answers[:index + 1]
        history = tuple(answer_from(a) for a in seen)
        if index is None:
            last = answer_from(seen[-1], history) if seen else None
            raise OutcomeTimeout(
                f"no {' or '.join(sorted(ends))} for run {run_id} within {timeout:g} s; "
                f"last answer: {last.type if last else 'none'}", last)
        answer = seen[index]
        if answer.get("type") == _wire.INTENT_REJECTED:
            raise refusal(Outcome.from_event(answer, history))
        return RunSummary.from_event(answer, history)

    return Request(event, settles, finish)


def compensate(source, run_id, reason):
    return run_message(source, run_id, _wire.COMPENSATE_RUN, _COMPENSATION_ENDS, reason=reason)


def cancel(source, run_id, reason, compensate):
    ends = _COMPENSATION_ENDS if compensate else frozenset({_wire.RUN_CANCELLED})
    return run_message(source, run_id, _wire.CANCEL_RUN, ends, reason=reason,
                       compensate=True if compensate else None)


def complete(source, run_id, reason):
    return run_message(source, run_id, _wire.COMPLETE_RUN, frozenset({_wire.RUN_COMPLETED}),
                       reason=reason)


def local_refusal(transport):
    """The IntentRefused for a message not sent because its reply destination is one the
    dispatcher refuses (whose refusal would go to <prefix>outcomes only)."""
    return IntentRefused(f"not sent: {transport.refusal}", None, reason="invalid_reply_to",
                         field=_wire.REPLY_TOPIC_HEADER, detail=transport.refusal)


def first_settling(answers, start, settles):
    """The index of the first answer from `start` on that ends the wait, or None."""
    for i in range(start, len(answers)):
        if settles(answers[i]):
            return i
    return None
