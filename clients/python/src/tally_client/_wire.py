"""The wire format of tally's agent protocol (docs/agent-protocol.md): the CloudEvents the
client publishes, the Kafka headers that name where their answers go, and reading answers
back. Pure functions and constants; no Kafka client here."""

import base64
import binascii
import json
import re
import secrets
import struct
import time
import uuid

INTENT = "tally.intent.v1"
COMPENSATE_RUN = "tally.compensate_run.v1"
CANCEL_RUN = "tally.cancel_run.v1"
COMPLETE_RUN = "tally.complete_run.v1"

INTENT_REJECTED = "tally.intent.rejected.v1"
RUN_COMPENSATED = "tally.run.compensated.v1"
RUN_STUCK = "tally.run.stuck.v1"
RUN_CANCELLED = "tally.run.cancelled.v1"
RUN_COMPLETED = "tally.run.completed.v1"

# Spring Kafka's request/reply headers, which the dispatcher and the relay honour.
REPLY_TOPIC_HEADER = "kafka_replyTopic"
REPLY_PARTITION_HEADER = "kafka_replyPartition"
CORRELATION_HEADER = "kafka_correlationId"

MAX_TOPIC_BYTES = 249
_NOT_TOPIC_CHAR = re.compile(r"[^A-Za-z0-9._-]")
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def now_rfc3339():
    """UTC with milliseconds, as tally writes its own events."""
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def new_correlation_id():
    """A fresh correlation id: 32 hex characters, as bytes (a Kafka header value)."""
    return uuid.uuid4().hex.encode("ascii")


def topic_safe(name):
    """`name` with every character Kafka does not allow in a topic name replaced by `_`."""
    return _NOT_TOPIC_CHAR.sub("_", name) or "_"


def private_reply_topic(topic_prefix, agent):
    """`<prefix>replies.<agent>.<16 hex>`: one process's own reply topic. The agent part is
    cut so the whole name fits Kafka's 249 characters."""
    head = f"{topic_prefix}replies."
    tail = "." + secrets.token_hex(8)
    room = MAX_TOPIC_BYTES - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"topic prefix {topic_prefix!r} leaves no room for a reply topic")
    return head + topic_safe(agent)[:room] + tail


def reply_topic_refusal(topic, partition, allowed_prefix):
    """Why the dispatcher would refuse this reply destination (`invalid_reply_to`), or None.
    A refused destination is never written to: the refusal goes to <prefix>outcomes only, so
    the client says it before publishing instead of waiting for an answer that cannot come."""
    if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
        return f"reply topic {topic!r} is not 1-249 characters of [A-Za-z0-9._-]"
    if not topic.startswith(allowed_prefix):
        return (f"reply topic {topic!r} is outside the allowed prefix {allowed_prefix!r} "
                "(TALLY_REPLY_TOPIC_PREFIX)")
    if partition is not None and not 0 <= partition <= 0x7FFFFFFF:
        return f"reply partition {partition} is not in 0-2147483647"
    return None


def reply_headers(topic, partition, correlation_id):
    """The Kafka headers of a published message: where its answers go, and its id."""
    headers = [("content-type", b"application/cloudevents+json"),
               (REPLY_TOPIC_HEADER, topic.encode("ascii")),
               (CORRELATION_HEADER, correlation_id)]
    if partition is not None:
        headers.append((REPLY_PARTITION_HEADER, struct.pack(">i", partition)))
    return headers


def cloudevent(type_, source, run_id, data):
    """A structured-mode CloudEvent, as a dict."""
    return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": source, "type": type_,
            "time": now_rfc3339(), "datacontenttype": "application/json", "subject": run_id,
            "data": data}


def intent_event(source, run_id, step, tool, args, tenant=None, operation_key=None,
                 traceparent=None):
    data = {"run_id": run_id, "step": step, "tool": tool, "args": args}
    if tenant is not None:
        data["tenant"] = tenant
    if operation_key is not None:
        data["operation_key"] = operation_key
    if traceparent is not None:
        data["traceparent"] = traceparent
    return cloudevent(INTENT, source, run_id, data)


def run_event(type_, source, run_id, reason=None, compensate=None):
    """compensate_run, cancel_run (which need a reason) or complete_run."""
    data = {"run_id": run_id}
    if reason is not None:
        data["reason"] = reason
    if compensate is not None:
        data["compensate"] = compensate
    return cloudevent(type_, source, run_id, data)


def encode(event):
    """The Kafka value: the whole event as UTF-8 JSON (not \\u-escaped)."""
    return json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def decode(value):
    """A CloudEvent (a dict with a string id and type) out of a Kafka value, or None."""
    try:
        event = json.loads(value)
    except (TypeError, ValueError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("id"), str) \
            or not isinstance(event.get("type"), str):
        return None
    return event


def correlation_of(headers, event):
    """The correlation id an answer carries: the `kafka_correlationId` header, else the
    `correlationid` (text) or `correlationidbase64` (any bytes) extension attribute."""
    for name, value in headers or ():
        if name == CORRELATION_HEADER and value is not None:
            return bytes(value)
    text = event.get("correlationid")
    if isinstance(text, str):
        return text.encode("utf-8")
    b64 = event.get("correlationidbase64")
    if isinstance(b64, str):
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            return None
    return None


def data_of(event):
    d = event.get("data")
    return d if isinstance(d, dict) else {}


def kind_of(event):
    """What an answer says, from its CloudEvents type: tally.effect.<kind>.v1 -> CONFIRMED,
    FAILED, UNKNOWN, ...; tally.run.<kind>.v1 -> COMPENSATED, STUCK, CANCELLED, COMPLETED;
    tally.intent.rejected.v1 -> REFUSED (not REJECTED, which is a human's denial)."""
    type_ = event.get("type")
    if type_ == INTENT_REJECTED:
        return "REFUSED"
    parts = str(type_).split(".")
    if len(parts) == 4 and parts[0] == "tally" and parts[1] in ("effect", "run"):
        return parts[2].upper()
    status = data_of(event).get("status")
    return status if isinstance(status, str) else "?"


# How a call's wait ends (docs/agents.md, "Reading outcomes"). The kinds tally still works on
# are waited through; DUPLICATE counts as confirmed (tally reverses the extra records), and
# COMPENSATED says an effect that happened was undone.
SETTLED_KINDS = frozenset({"CONFIRMED", "DUPLICATE", "COMPENSATED", "FAILED", "CONFLICT",
                           "REJECTED", "CANCELLED", "REFUSED"})
WAITING_KINDS = frozenset({"UNKNOWN", "AWAITING_APPROVAL", "STUCK", "PLANNED", "DISPATCHING"})
_FINAL_LEDGER_STATES = frozenset({"CONFIRMED", "FAILED", "REJECTED", "CANCELLED", "CONFLICT"})


def settles_call(event):
    """Whether this answer to an intent is its final one."""
    kind = kind_of(event)
    if kind in SETTLED_KINDS:
        return True
    if kind in WAITING_KINDS:
        return False
    # A kind newer than this client: trust the ledger state it reports.
    return data_of(event).get("status") in _FINAL_LEDGER_STATES
