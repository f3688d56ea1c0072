"""What tally answers, as typed values: Outcome (an effect's state, from a
tally.effect.*.v1 or tally.intent.rejected.v1 event) and RunSummary (a run's, from a
tally.run.*.v1 event)."""

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple, Union

from ._wire import data_of, kind_of


@dataclass(frozen=True)
class Outcome:
    """One answer about an effect.

    `status` is what the answer says, from its CloudEvents type (CONFIRMED, FAILED, UNKNOWN,
    DUPLICATE, CONFLICT, REJECTED, AWAITING_APPROVAL, STUCK, COMPENSATED, CANCELLED, PLANNED,
    DISPATCHING; REFUSED for tally.intent.rejected.v1). `event` is the raw CloudEvent and
    `history` every answer the call saw, in arrival order, this one last.
    """

    status: str
    effect_id: Optional[str]
    run_id: Optional[str]
    step: Union[int, str, None]
    tool: Optional[str]
    operation_key: Optional[str]
    receipt: Optional[dict]
    external_ref: Optional[str]
    attempts: Optional[int]
    replay: bool
    error: Optional[dict]
    intent_id: Optional[str]
    event: dict = field(repr=False, compare=False)
    history: Tuple["Outcome", ...] = field(default=(), repr=False, compare=False)

    @property
    def ok(self):
        """The tool did it (CONFIRMED; DUPLICATE, whose extra records tally reverses)."""
        return self.status in ("CONFIRMED", "DUPLICATE")

    @property
    def type(self):
        return self.event.get("type")

    @classmethod
    def from_event(cls, event, history=()):
        d = data_of(event)
        error = d.get("error") if isinstance(d.get("error"), dict) else None
        if kind_of(event) == "REFUSED":
            error = {"code": d.get("reason"), "message": d.get("detail")}
        return cls(status=kind_of(event), effect_id=d.get("effect_id"), run_id=d.get("run_id"),
                   step=d.get("step"), tool=d.get("tool"), operation_key=d.get("operation_key"),
                   receipt=d.get("receipt"), external_ref=d.get("external_ref"),
                   attempts=d.get("attempts"), replay=d.get("replay") is True, error=error,
                   intent_id=d.get("intent_id"), event=event, history=tuple(history))


@dataclass(frozen=True)
class RunSummary:
    """How a run ended: tally.run.compensated.v1 / stuck.v1 (`summary` holds compensated,
    uncompensatable, skipped, failed), tally.run.cancelled.v1 (`effects_cancelled`) or
    tally.run.completed.v1 (`summary` holds total, effects, open, open_count).

    `status` is the run's state as tally wrote it (COMPENSATED, PARTIALLY_COMPENSATED,
    STUCK, CANCELLED, COMPLETED).
    """

    run_id: str
    status: str
    reason: Optional[str]
    summary: dict
    effects_cancelled: Optional[int]
    event: dict = field(repr=False, compare=False)
    history: Tuple[Any, ...] = field(default=(), repr=False, compare=False)

    @property
    def type(self):
        return self.event.get("type")

    def _items(self, name):
        items = self.summary.get(name)
        return items if isinstance(items, list) else []

    @property
    def compensated(self):
        return self._items("compensated")

    @property
    def uncompensatable(self):
        return self._items("uncompensatable")

    @property
    def skipped(self):
        return self._items("skipped")

    @property
    def failed(self):
        return self._items("failed")

    @property
    def open(self):
        """The effects a completed run left waiting for a human (at most 100 listed)."""
        return self._items("open")

    @classmethod
    def from_event(cls, event, history=()):
        d = data_of(event)
        summary = d.get("summary") if isinstance(d.get("summary"), dict) else {}
        return cls(run_id=d.get("run_id"), status=d.get("status"), reason=d.get("reason"),
                   summary=summary, effects_cancelled=d.get("effects_cancelled"), event=event,
                   history=tuple(history))


def answer_from(event, history=()):
    """An Outcome, or a RunSummary for a tally.run.*.v1 event."""
    if str(event.get("type", "")).startswith("tally.run."):
        return RunSummary.from_event(event, history)
    return Outcome.from_event(event, history)
