"""The errors the client raises. Every one is a TallyError."""


class TallyError(Exception):
    """Base class. `outcome` is the answer that caused it (an Outcome), or None."""

    def __init__(self, message, outcome=None):
        super().__init__(message)
        self.outcome = outcome

    @property
    def code(self):
        """`error.code` of the answer (http_422, timeout, conflict, ...), or None."""
        error = getattr(self.outcome, "error", None) or {}
        return error.get("code")

    @property
    def message(self):
        """`error.message` of the answer, or None."""
        error = getattr(self.outcome, "error", None) or {}
        return error.get("message")


class PublishError(TallyError):
    """Kafka did not take the message (no delivery report, or a failed one): tally has not
    seen it. Publishing the same intent again is safe."""


class EffectError(TallyError):
    """tally answered, and the effect did not happen (or will not)."""


class EffectFailed(EffectError):
    """FAILED: the tool refused (a 4xx) or the retries ran out; nothing happened."""


class EffectConflict(EffectError):
    """CONFLICT: the operation key or the step already belongs to an effect with other
    arguments; nothing was called. A bug in the agent: a changed plan needs a new key."""


class EffectRejected(EffectError):
    """REJECTED: a human denied the approval (`tally deny`)."""


class EffectCancelled(EffectError):
    """CANCELLED: the run was stopped before the effect was applied."""


class IntentRefused(TallyError):
    """tally.intent.rejected.v1: the message was refused before it became an effect.
    `reason` is machine-readable (unknown_tool, invalid_field, run_not_active,
    invalid_reply_to, ...), `field` the field at fault (data.tool, replytopic) or None,
    `detail` one sentence, `dlq` where the original message was dead-lettered, or None."""

    def __init__(self, message, outcome=None, reason=None, field=None, detail=None, dlq=None):
        super().__init__(message, outcome)
        self.reason = reason
        self.field = field
        self.detail = detail
        self.dlq = dlq

    @property
    def code(self):
        return self.reason

    @property
    def message(self):
        return self.detail


class OutcomeTimeout(TallyError):
    """No final answer within the timeout. `last` is the last answer seen (an Outcome or a
    RunSummary, e.g. UNKNOWN or AWAITING_APPROVAL), or None when nothing came. The effect may
    still settle: publishing the same intent again returns its state, without a second call."""

    def __init__(self, message, last=None):
        super().__init__(message, last)
        self.last = last


_EFFECT_ERRORS = {"FAILED": EffectFailed, "CONFLICT": EffectConflict,
                  "REJECTED": EffectRejected, "CANCELLED": EffectCancelled}


def refusal(outcome):
    """The IntentRefused for a tally.intent.rejected.v1 answer."""
    d = outcome.event.get("data") if isinstance(outcome.event.get("data"), dict) else {}
    reason, fld, detail = d.get("reason"), d.get("field"), d.get("detail")
    where = f" ({fld})" if fld else ""
    return IntentRefused(f"tally refused {d.get('type') or 'the message'} {d.get('intent_id')}:"
                         f" {reason}{where}: {detail}", outcome, reason=reason, field=fld,
                         detail=detail, dlq=d.get("dlq"))


def effect_error(outcome):
    """The error a final answer raises, or None when it is a success."""
    if outcome.status == "REFUSED":
        return refusal(outcome)
    cls = _EFFECT_ERRORS.get(outcome.status)
    if cls is None:
        return None
    err = outcome.error or {}
    return cls(f"step {outcome.step!r} ({outcome.tool}) of run {outcome.run_id}: "
               f"{outcome.status}: {err.get('code')}: {err.get('message')}", outcome)
