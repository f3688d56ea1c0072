// The TypeScript example agent (docs/agents.md, "Publishing from TypeScript"): one run of two
// steps, each published and answered, then step 2 published again as an agent unsure of its
// first send would: the answer is the same effect, and the tool is not called a second time.
// Prints one JSON line per answer; exits 0 when every answer is CONFIRMED and the replay names
// the first effect, 1 otherwise.
//
//   TALLY_KAFKA_BROKERS=host:9092 TALLY_TOPIC_PREFIX=tally. node dist/main.js
import { randomUUID } from "node:crypto";
import { Outcome, Tally } from "./tally";

function report(label: string, o: Outcome): void {
  const d = o.data;
  console.log(
    JSON.stringify({
      label,
      type: o.type,
      run_id: d.run_id,
      step: d.step,
      tool: d.tool,
      status: d.status,
      effect_id: d.effect_id,
      external_ref: d.external_ref,
      error: d.error,
      intent_id: d.intent_id,
    }),
  );
}

async function main(): Promise<number> {
  const brokers = (process.env.TALLY_KAFKA_BROKERS ?? "localhost:9092").split(",");
  const tally = new Tally(brokers, process.env.TALLY_TOPIC_PREFIX ?? "tally.");
  await tally.connect();
  try {
    const tag = randomUUID().slice(0, 8);
    const runId = `ts-${tag}`;
    const traceId = randomUUID().replace(/-/g, "");
    const steps = [
      { step: 1, tool: "check_balance", args: { request_id: `rq-${tag}`, account_id: "acct-7" } },
      {
        step: 2,
        tool: "update_ledger",
        args: { entry_id: `le-${tag}`, amount: 1250, currency: "EUR" },
      },
    ];
    let ok = true;
    const effects: Array<string | null> = [];
    for (const s of steps) {
      const id = await tally.publishIntent({ runId, traceId, ...s });
      const o = await tally.outcome(id);
      report(`step ${s.step}`, o);
      ok &&= o.data.status === "CONFIRMED";
      effects.push(o.data.effect_id);
    }
    // Not sure the last send went through (a timeout, a crash)? Send it again, unchanged.
    const again = await tally.publishIntent({ runId, traceId, ...steps[1] });
    const replay = await tally.outcome(again);
    report("step 2 again", replay);
    ok &&= replay.data.status === "CONFIRMED" && replay.data.effect_id === effects[1];
    return ok ? 0 : 1;
  } finally {
    await tally.close();
  }
}

main().then(
  (code) => process.exit(code),
  (err) => {
    console.error(`tally-agent-ts: ${err instanceof Error ? err.message : String(err)}`);
    process.exit(1);
  },
);
