"""tally-client: publish intents to tally and get their answers.

    from tally_client import Tally
    with Tally("127.0.0.1:9092", agent="billing-bot") as tally:
        run = tally.run("run-42")
        outcome = run.call(1, "charge_card", {"tenant_id": "t1", "payment_id": "p1",
                                              "amount": 500})
        summary = run.complete()

The wire contract is docs/agent-protocol.md of the tally repository; the asyncio API is
tally_client.aio.AsyncTally.
"""

from .client import Run, Tally
from .errors import (EffectCancelled, EffectConflict, EffectError, EffectFailed,
                     EffectRejected, IntentRefused, OutcomeTimeout, PublishError, TallyError)
from .outcome import Outcome, RunSummary

__version__ = "0.1.0"

__all__ = ["Tally", "Run", "Outcome", "RunSummary", "TallyError", "PublishError",
           "EffectError", "EffectFailed", "EffectConflict", "EffectRejected",
           "EffectCancelled", "IntentRefused", "OutcomeTimeout"]
