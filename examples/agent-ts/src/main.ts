// The TypeScript example agent (docs/agents.md, "Publishing from TypeScript"), written with
// @tally/client (clients/typescript): one run of two steps, each published and answered, then
// step 2 published again as an agent unsure of its first send would — the answer is the same
// effect, and the tool is not called a second time — then the run is completed.
// Prints one JSON line per answer; exits 0 when every step is CONFIRMED, the replay names the
// first effect and the run is COMPLETED, 1 otherwise.
//
//   TALLY_KAFKA_BROKERS=host:9092 TALLY_TOPIC_PREFIX=tally. node dist/main.js
import { randomBytes, randomUUID } from "node:crypto";
import { Outcome, RunOutcome, Tally } from "@tally/client";

function report(label: string, o: Outcome): void {
  console.log(
    JSON.stringify({
      label,
      type: o.type,
      run_id: o.runId,
      step: o.step,
      tool: o.tool,
      status: o.status,
      effect_id: o.effectId,
      external_ref: o.externalRef,
      error: o.error,
      intent_id: o.intentId,
      replay: o.replay,
    }),
  );
}

function reportRun(label: string, r: RunOutcome): void {
  console.log(
    JSON.stringify({ label, type: r.type, run_id: r.runId, status: r.status, summary: r.summary }),
  );
}

async function main(): Promise<number> {
  const tally = await Tally.connect({
    brokers: (process.env.TALLY_KAFKA_BROKERS ?? "localhost:9092").split(","),
    topicPrefix: process.env.TALLY_TOPIC_PREFIX ?? "tally.",
    agent: "ts-example",
  });
  try {
    const tag = randomUUID().slice(0, 8);
    const run = tally.run(`ts-${tag}`);
    // One trace for the run, a span per step: tally hands it to the tool as `traceparent`.
    const traceId = randomBytes(16).toString("hex");
    const traceparent = (): string => `00-${traceId}-${randomBytes(8).toString("hex")}-01`;
    const balance = { request_id: `rq-${tag}`, account_id: "acct-7" };
    const entry = { entry_id: `le-${tag}`, amount: 1250, currency: "EUR" };

    let ok = true;
    const first = await run.call(1, "check_balance", balance, { traceparent: traceparent() });
    report("step 1", first);
    const second = await run.call(2, "update_ledger", entry, { traceparent: traceparent() });
    report("step 2", second);
    ok &&= first.status === "CONFIRMED" && second.status === "CONFIRMED";

    // Not sure the last send went through (a timeout, a crash)? Send it again, unchanged: the
    // same tool, key and arguments are the same effect.
    const replay = await run.call(2, "update_ledger", entry, { traceparent: traceparent() });
    report("step 2 again", replay);
    ok &&= replay.status === "CONFIRMED" && replay.replay && replay.effectId === second.effectId;

    const done = await run.complete({ reason: "the example is done" });
    reportRun("run completed", done);
    ok &&= done.status === "COMPLETED";
    return ok ? 0 : 1;
  } finally {
    await tally.close();
  }
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(
      `tally-agent-ts: ${err instanceof Error ? `${err.name}: ${err.message}` : String(err)}`,
    );
    process.exit(1);
  },
);
