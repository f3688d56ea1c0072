// A small client of tally's Kafka contract (DESIGN §5, docs/agents.md): intents go to
// <prefix>intents as tally.intent.v1 CloudEvents keyed by run id; every answer comes back on
// <prefix>outcomes as a tally.effect.<kind>.v1 event naming the intent in data.intent_id.
import { randomBytes, randomUUID } from "node:crypto";
import { Consumer, Kafka, logLevel, Partitioners, Producer } from "kafkajs";

export interface Intent {
  runId: string;
  step: number | string; // unique in the run; an integer orders the saga by value
  tool: string; // a name in tally's tool registry
  args: Record<string, unknown>;
  operationKey?: string; // only for tools whose registry entry has no operation_key fields
  traceId?: string; // 32 hex digits: sent as a W3C traceparent, forwarded to the tool
}

/** The fields of an answer that agents rely on (DESIGN §5); more may come. */
export interface Outcome {
  type: string; // tally.effect.confirmed.v1, .failed.v1, .unknown.v1, .conflict.v1, ...
  id: string;
  data: {
    effect_id: string | null;
    run_id: string;
    step: number | string;
    tool: string;
    operation_key: string | null;
    status: string; // CONFIRMED, FAILED, UNKNOWN, CONFLICT, AWAITING_APPROVAL, ...
    receipt: Record<string, unknown> | null; // the tool's own record, when CONFIRMED
    external_ref: string | null;
    error: { code: string; message: string } | null;
    attempts: number;
    intent_id: string;
  };
}

export class Tally {
  private readonly kafka: Kafka;
  private readonly producer: Producer;
  private readonly consumer: Consumer;
  private readonly pending = new Set<string>(); // published here, answer not yet taken
  private readonly waiting = new Map<string, (o: Outcome) => void>();
  private readonly arrived = new Map<string, Outcome>(); // answered before outcome() asked

  constructor(
    brokers: string[],
    private readonly prefix = "tally.",
    private readonly source = "/agents/ts-example",
  ) {
    this.kafka = new Kafka({ clientId: "tally-agent-ts", brokers, logLevel: logLevel.WARN });
    // Not idempotent, and it need not be: a retried send that lands twice is the same intent
    // twice, which tally answers with the existing effect instead of calling the tool again.
    // The key (the run id) picks the partition, so one run stays in order; which partitioner
    // maps it does not matter to tally.
    this.producer = this.kafka.producer({
      allowAutoTopicCreation: false,
      createPartitioner: Partitioners.DefaultPartitioner,
    });
    // A group of its own, reading from the end: this process wants only the answers to what
    // it publishes from now on. An agent that must find its answers after a restart keeps
    // a stable groupId and commits its offsets instead.
    this.consumer = this.kafka.consumer({
      groupId: `tally-agent-ts-${randomUUID()}`,
      maxWaitTimeInMs: 500,
    });
  }

  /** Connects both clients; resolves once the outcomes consumer reads from the topic's end,
   * so no answer to an intent published after this can be missed. */
  async connect(): Promise<void> {
    await this.producer.connect();
    await this.consumer.connect();
    await this.consumer.subscribe({ topic: this.prefix + "outcomes", fromBeginning: false });
    const reading = new Promise<void>((resolve) => {
      const stop = this.consumer.on(this.consumer.events.FETCH, () => {
        stop();
        resolve();
      });
    });
    await this.consumer.run({
      eachMessage: async ({ message }) => {
        let ev: Outcome;
        try {
          ev = JSON.parse(message.value?.toString() ?? "");
        } catch {
          return; // not ours to judge: other producers may share the topic
        }
        const id = ev?.data?.intent_id;
        if (typeof id !== "string" || !this.pending.has(id)) return; // another agent's
        if (!ev.type?.startsWith("tally.effect.")) return;
        const resolve = this.waiting.get(id);
        if (resolve) {
          this.waiting.delete(id);
          this.pending.delete(id);
          resolve(ev);
        } else if (!this.arrived.has(id)) {
          this.arrived.set(id, ev);
        }
      },
    });
    await reading;
  }

  /** Publishes one intent and resolves with its CloudEvents id once Kafka has it (acks from
   * every in-sync replica): tally answers with that id in data.intent_id. */
  async publishIntent(intent: Intent): Promise<string> {
    const id = randomUUID();
    const data: Record<string, unknown> = {
      run_id: intent.runId,
      step: intent.step,
      tool: intent.tool,
      args: intent.args,
    };
    if (intent.operationKey !== undefined) data.operation_key = intent.operationKey;
    if (intent.traceId !== undefined)
      data.traceparent = `00-${intent.traceId}-${randomBytes(8).toString("hex")}-01`;
    const event = {
      specversion: "1.0",
      id,
      source: this.source,
      type: "tally.intent.v1",
      time: new Date().toISOString(),
      datacontenttype: "application/json",
      subject: intent.runId,
      data,
    };
    this.pending.add(id); // before the send: the answer may arrive before it returns
    try {
      await this.producer.send({
        topic: this.prefix + "intents",
        acks: -1,
        messages: [
          {
            key: intent.runId, // one run stays in order on one partition
            value: JSON.stringify(event),
            headers: { "content-type": "application/cloudevents+json" },
          },
        ],
      });
    } catch (err) {
      // Not acknowledged: it may still have landed. Publishing the same intent again is safe.
      this.pending.delete(id);
      throw err;
    }
    return id;
  }

  /** The first answer to an intent published here, or an error after timeoutMs. After an
   * UNKNOWN answer the final one comes later, naming the same effect_id (docs/agents.md);
   * this small client returns the first only. */
  outcome(intentId: string, timeoutMs = 30000): Promise<Outcome> {
    const early = this.arrived.get(intentId);
    if (early) {
      this.arrived.delete(intentId);
      this.pending.delete(intentId);
      return Promise.resolve(early);
    }
    if (!this.pending.has(intentId))
      return Promise.reject(new Error(`intent ${intentId} was not published by this client`));
    return new Promise<Outcome>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting.delete(intentId);
        this.pending.delete(intentId);
        reject(new Error(`no answer to intent ${intentId} within ${timeoutMs} ms`));
      }, timeoutMs);
      this.waiting.set(intentId, (o) => {
        clearTimeout(timer);
        resolve(o);
      });
    });
  }

  async close(): Promise<void> {
    await this.consumer.disconnect();
    await this.producer.disconnect();
  }
}
