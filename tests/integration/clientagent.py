#!/usr/bin/python3
"""An agent process for test_client_python.py: it makes the calls it is given with the
repository's tally_client and prints what it got, one JSON line each.

    clientagent.py SPEC_JSON

SPEC_JSON: {"brokers", "prefix", "agent", "timeout", "calls": [{"run", "step", "tool",
"args"}]}. Prints {"reply_topic"} once started, {"outcome": {...}} or {"error": {...}} per
call, then {"stats": {...}} (tally.stats() of its client) before it exits 0.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "clients", "python", "src"))

from tally_client import Tally, TallyError  # noqa: E402


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def outcome_json(o):
    return {"status": o.status, "effect_id": o.effect_id, "run_id": o.run_id, "step": o.step,
            "tool": o.tool, "operation_key": o.operation_key, "replay": o.replay,
            "intent_id": o.intent_id, "external_ref": o.external_ref,
            "history": [{"status": h.status, "replay": h.replay, "id": h.event.get("id")}
                        for h in o.history]}


def main():
    spec = json.loads(sys.argv[1])
    with Tally(spec["brokers"], spec["agent"], topic_prefix=spec["prefix"]) as tally:
        emit({"reply_topic": tally.reply_topic})
        for c in spec["calls"]:
            try:
                o = tally.run(c["run"]).call(c["step"], c["tool"], c["args"],
                                             timeout=spec.get("timeout", 30))
                emit({"outcome": outcome_json(o)})
            except TallyError as e:
                emit({"error": {"type": type(e).__name__, "text": str(e)}})
        emit({"stats": tally.stats()})


if __name__ == "__main__":
    main()
