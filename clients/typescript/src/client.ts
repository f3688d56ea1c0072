// The client: one producer for `<prefix>intents`, one reader of this process's reply topic, and
// the calls waiting between the two. docs/agent-protocol.md is the contract.
import { randomBytes, randomUUID } from "node:crypto";
import {
  Admin,
  AssignerProtocol,
  Consumer,
  ConsumerConfig,
  Kafka,
  logLevel,
  PartitionAssigner,
  Partitioners,
  Producer,
  ProducerConfig,
} from "kafkajs";
import { judgeIntentAnswer, judgeRunAnswer, Verdict } from "./answers";
import { IntentRefused, OutcomeTimeout, PublishFailed, TallyClosed, TallyError } from "./errors";
import {
  checkDestination,
  defaultReplyTopic,
  ReplyDestination,
  replyHeaders,
  ReplyRouter,
  sanitizeAgent,
} from "./replies";
import type {
  CallOptions,
  CancelOptions,
  CloudEvent,
  CompensateOptions,
  CompleteOptions,
  Outcome,
  RunOptions,
  RunOutcome,
  Step,
  TallyOptions,
  TallyStats,
} from "./types";

type Judge<T> = (ev: CloudEvent, history: CloudEvent[]) => { verdict: Verdict<T>; outcome?: T };

/** The assigner of a reader that wants one partition of a topic: its group is its own, so the
 * only member gets that partition and nothing else. */
function onePartition(topic: string, partition: number): PartitionAssigner {
  const name = "TallyOnePartition";
  return () => ({
    name,
    version: 1,
    async assign({ members }) {
      return members.map((m, i) => ({
        memberId: m.memberId,
        memberAssignment: AssignerProtocol.MemberAssignment.encode({
          version: 1,
          assignment: i === 0 ? { [topic]: [partition] } : {},
          userData: Buffer.alloc(0),
        }),
      }));
    },
    protocol({ topics }) {
      return {
        name,
        metadata: AssignerProtocol.MemberMetadata.encode({
          version: 1,
          topics,
          userData: Buffer.alloc(0),
        }),
      };
    },
  });
}

function errorText(err: unknown): string {
  return err instanceof Error ? `${err.name}: ${err.message}` : String(err);
}

/**
 * A connection to tally: publishes intents and run messages to `<prefix>intents`, each naming
 * this process's reply topic, and hands every answer tally sends there to the call waiting
 * for it.
 *
 * ```ts
 * const tally = await Tally.connect({ brokers: ["127.0.0.1:9092"], agent: "billing-bot" });
 * const run = tally.run("run-42");
 * const o = await run.call(1, "charge_card", { tenant_id: "t1", payment_id: "p1", amount: 5 });
 * await tally.close();
 * ```
 */
export class Tally {
  private readonly calls = new Set<(err: Error) => void>();
  private closed = false;
  private broken: Error | undefined;

  private constructor(
    private readonly admin: Admin,
    private readonly router: ReplyRouter,
    private readonly producer: Producer,
    private readonly consumer: Consumer | undefined,
    private readonly destination: ReplyDestination,
    /** why tally would refuse the destination, when it would */
    private readonly refusedDestination: { field: string; detail: string } | null,
    /** a topic this process made for itself, deleted by close() */
    private readonly ownTopic: boolean,
    readonly agent: string,
    readonly topicPrefix: string,
    readonly source: string,
  ) {}

  /**
   * Connects to Kafka and starts reading answers. Resolves once the reply reader has made its
   * first fetch, so the answer to anything published after that is read.
   *
   * Without `replyTopic`, answers go to a topic of this process's own,
   * `<prefix>replies.<agent>.<16 hex>`, created here with one partition (or, on a cluster that
   * cannot create topics on request, by Kafka's automatic topic creation) and deleted by
   * `close()`. It is read from its beginning in a consumer group of its own; joining that
   * group takes Kafka's `group.initial.rebalance.delay.ms` (3 s by default, and on the mock
   * cluster of `tally dev`).
   */
  static async connect(options: TallyOptions): Promise<Tally> {
    if (!Array.isArray(options.brokers) || options.brokers.length === 0)
      throw new TypeError("Tally.connect: brokers must name at least one broker");
    if (typeof options.agent !== "string" || options.agent.length === 0)
      throw new TypeError("Tally.connect: agent must be a non-empty string");
    if (options.replyPartition !== undefined && options.replyTopic === undefined)
      throw new TypeError("Tally.connect: replyPartition needs replyTopic");
    const prefix = options.topicPrefix ?? "tally.";
    const allowed = options.replyTopicPrefix ?? `${prefix}replies.`;
    const agent = options.agent;
    const own = options.replyTopic === undefined;
    const destination: ReplyDestination = own
      ? { topic: defaultReplyTopic(allowed, agent, randomBytes(8).toString("hex")) }
      : { topic: options.replyTopic as string, partition: options.replyPartition };
    const refused = checkDestination(destination, allowed);
    const source = options.source ?? `/agents/${encodeURIComponent(agent)}`;
    const timeoutMs = options.connectTimeoutMs ?? 60000;

    const kafka = new Kafka({
      clientId: `tally-client-${sanitizeAgent(agent)}`,
      logLevel: logLevel.WARN,
      ...options.kafka,
      brokers: options.brokers,
    });
    const admin = kafka.admin();
    let producer: Producer | undefined;
    let consumer: Consumer | undefined;
    try {
      await admin.connect();
      if (own && refused === null) await Tally.createReplyTopic(kafka, admin, destination.topic);
      const idempotent = options.idempotent ?? true;
      const router = new ReplyRouter();
      let made: Tally | undefined;
      const reading =
        refused === null
          ? Tally.startReader(
              kafka,
              agent,
              destination,
              own,
              options.consumer,
              timeoutMs,
              router,
              (err) => made?.readerStopped(err),
            )
          : Promise.resolve(undefined);
      // Both at once: the reader's first group join is the slow part.
      const [p, c] = await Promise.allSettled([
        Tally.startProducer(kafka, idempotent, options.producer),
        reading,
      ]);
      if (p.status === "fulfilled") producer = p.value;
      if (c.status === "fulfilled") consumer = c.value;
      if (p.status === "rejected") throw p.reason;
      if (c.status === "rejected") throw c.reason;
      if (refused !== null)
        kafka.logger().warn(`tally: every message would be refused: ${refused.detail}`, {
          replyTopic: destination.topic,
        });
      made = new Tally(
        admin,
        router,
        producer as Producer,
        consumer,
        destination,
        refused,
        own && refused === null,
        agent,
        prefix,
        source,
      );
      return made;
    } catch (err) {
      await Promise.allSettled([consumer?.disconnect(), producer?.disconnect()]);
      if (own && refused === null)
        await admin
          .deleteTopics({ topics: [destination.topic], timeout: 5000 })
          .catch(() => undefined);
      await admin.disconnect().catch(() => undefined);
      throw err;
    }
  }

  private static async createReplyTopic(kafka: Kafka, admin: Admin, topic: string): Promise<void> {
    try {
      await admin.createTopics({
        topics: [{ topic, numPartitions: 1 }],
        waitForLeaders: true,
        timeout: 10000,
      });
      return;
    } catch (err) {
      // librdkafka's mock cluster has no controller to ask: its metadata request creates the
      // topic instead (with the cluster's default partition count; all are read).
      kafka
        .logger()
        .info(
          `tally: createTopics failed (${errorText(err)}); relying on automatic topic creation`,
          {
            topic,
          },
        );
      try {
        await admin.fetchTopicMetadata({ topics: [topic] });
      } catch (err2) {
        throw new TallyError(
          "reply_topic",
          `cannot create the reply topic ${topic}: ${errorText(err)}; nor does the cluster ` +
            `create it on use: ${errorText(err2)}. Give an existing topic as replyTopic.`,
          undefined,
          err,
        );
      }
    }
  }

  private static async startProducer(
    kafka: Kafka,
    idempotent: boolean,
    overrides: Partial<ProducerConfig> | undefined,
  ): Promise<Producer> {
    const make = (idem: boolean): Producer =>
      kafka.producer({
        allowAutoTopicCreation: false,
        // the key (the run id) picks the partition, so one run's messages stay in order
        createPartitioner: Partitioners.DefaultPartitioner,
        idempotent: idem,
        // kafkajs's idempotent producer keeps sequence numbers right only one request at a time
        ...(idem ? { maxInFlightRequests: 1 } : {}),
        ...overrides,
      });
    const producer = make(idempotent);
    try {
      await producer.connect();
      return producer;
    } catch (err) {
      await producer.disconnect().catch(() => undefined);
      if (!idempotent || !(err instanceof Error) || err.name !== "KafkaJSBrokerNotFound") throw err;
      // No controller to give a producer id (librdkafka's mock cluster). Without one, a
      // retried send may land twice: tally answers a twice-published intent with the same
      // effect, so that costs a duplicate answer, not a second call of the tool.
      kafka
        .logger()
        .warn(`tally: the idempotent producer cannot start (${errorText(err)}); using a plain one`);
      const plain = make(false);
      await plain.connect();
      return plain;
    }
  }

  private static async startReader(
    kafka: Kafka,
    agent: string,
    dest: ReplyDestination,
    own: boolean,
    overrides: Partial<ConsumerConfig> | undefined,
    timeoutMs: number,
    router: ReplyRouter,
    stopped: (err: Error) => void,
  ): Promise<Consumer> {
    const consumer = kafka.consumer({
      // a group of its own: it is assigned every partition it asks for, and shares no offsets
      groupId: `tally-client.${sanitizeAgent(agent)}.${randomBytes(8).toString("hex")}`,
      // the mock broker holds an empty fetch for its whole wait even when data arrives
      // meanwhile; a real broker answers as soon as there is data either way
      maxWaitTimeInMs: 20,
      allowAutoTopicCreation: false,
      ...(dest.partition !== undefined
        ? { partitionAssigners: [onePartition(dest.topic, dest.partition)] }
        : {}),
      ...overrides,
    });
    await consumer.connect();
    try {
      // A topic of its own is read from its beginning: nothing in it is anyone else's, and an
      // answer that came before the join is not lost. A shared topic is read from its end.
      await consumer.subscribe({ topics: [dest.topic], fromBeginning: own });
      const ready = new Promise<void>((resolve, reject) => {
        const timer = setTimeout(() => {
          stopFetch();
          stopCrash();
          reject(
            new TallyError(
              "connect_timeout",
              `the reply reader of ${dest.topic} did not start within ${timeoutMs} ms`,
            ),
          );
        }, timeoutMs);
        // the first fetch comes after the group join and the offsets' resolution
        const stopFetch = consumer.on(consumer.events.FETCH, () => {
          clearTimeout(timer);
          stopFetch();
          stopCrash();
          resolve();
        });
        const stopCrash = consumer.on(consumer.events.CRASH, (e) => {
          clearTimeout(timer);
          stopFetch();
          stopCrash();
          reject(
            new TallyError(
              "reader_crashed",
              `the reply reader of ${dest.topic} stopped: ${errorText(e.payload.error)}`,
              undefined,
              e.payload.error,
            ),
          );
        });
      });
      consumer.on(consumer.events.CRASH, (e) => {
        if (!e.payload.restart)
          stopped(
            new TallyError(
              "reader_crashed",
              `the reply reader of ${dest.topic} stopped: ${errorText(e.payload.error)}`,
              undefined,
              e.payload.error,
            ),
          );
      });
      await consumer.run({
        eachMessage: async ({ message }) => {
          router.deliver(message);
        },
      });
      await ready;
      return consumer;
    } catch (err) {
      await consumer.disconnect().catch(() => undefined);
      throw err;
    }
  }

  /** The reply reader stopped for good: nothing waiting can be answered any more. */
  private readerStopped(err: Error): void {
    if (this.closed || this.broken) return;
    this.broken = err;
    this.failAll(new TallyClosed(err.message, err));
  }

  /** The topic answers come to. */
  get replyTopic(): string {
    return this.destination.topic;
  }

  /** The partition answers come to, when one was named. */
  get replyPartition(): number | undefined {
    return this.destination.partition;
  }

  /** A run: the unit tally compensates, completes and cancels. Its id is the Kafka key of every
   * message about it, so they stay in order. */
  run(runId: string, options: RunOptions = {}): Run {
    if (typeof runId !== "string" || runId.length === 0)
      throw new TypeError("run: runId must be a non-empty string");
    return new Run(this, runId, options.tenant);
  }

  /** What the reply reader has read (see TallyStats). */
  stats(): TallyStats {
    return this.router.stats();
  }

  /** Stops reading and publishing; calls still waiting reject with TallyClosed. Deletes this
   * process's own reply topic (a cluster that cannot delete topics keeps it). */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.failAll(new TallyClosed());
    await Promise.allSettled([this.consumer?.disconnect(), this.producer.disconnect()]);
    if (this.ownTopic)
      await this.admin
        .deleteTopics({ topics: [this.destination.topic], timeout: 5000 })
        .catch(() => undefined);
    await this.admin.disconnect().catch(() => undefined);
  }

  private failAll(err: Error): void {
    for (const fail of [...this.calls]) fail(err);
  }

  /** @internal Publishes one message about a run and waits for the answer `judge` accepts. */
  request<T extends Outcome | RunOutcome>(
    type: string,
    runId: string,
    data: Record<string, unknown>,
    timeoutMs: number,
    judge: (intentId: string) => Judge<T>,
  ): Promise<T> {
    if (this.closed) return Promise.reject(new TallyClosed());
    if (this.broken) return Promise.reject(new TallyClosed(this.broken.message, this.broken));
    if (!(Number.isFinite(timeoutMs) && timeoutMs >= 0))
      return Promise.reject(
        new TypeError(`timeoutMs must be a non-negative number, not ${timeoutMs}`),
      );
    const id = randomUUID();
    if (this.refusedDestination !== null) {
      const r = this.refusedDestination;
      return Promise.reject(new IntentRefused(id, "invalid_reply_to", r.field, r.detail));
    }
    const correlationId = randomUUID();
    const event = {
      specversion: "1.0",
      id,
      source: this.source,
      type,
      time: new Date().toISOString(),
      datacontenttype: "application/json",
      subject: runId,
      data,
    };
    const judgeOne = judge(id);
    return new Promise<T>((resolve, reject) => {
      const history: CloudEvent[] = [];
      let last: T | undefined;
      let timer: NodeJS.Timeout | undefined;
      let done = false;
      const finish = (err: Error | undefined, value?: T): void => {
        if (done) return;
        done = true;
        if (timer !== undefined) clearTimeout(timer);
        this.router.unregister(correlationId);
        this.calls.delete(fail);
        if (err) reject(err);
        else resolve(value as T);
      };
      const fail = (err: Error): void => finish(err);
      // Registered before the send: an answer may be read before the send resolves.
      this.router.register(correlationId, {
        answer: (ev) => {
          history.push(ev);
          const { verdict, outcome } = judgeOne(ev, history);
          if (outcome !== undefined) last = outcome;
          if (verdict.kind === "resolve") finish(undefined, verdict.value);
          else if (verdict.kind === "reject") finish(verdict.error);
        },
      });
      this.calls.add(fail);
      // One deadline for the whole call: the publish, then the answers.
      let published = false;
      timer = setTimeout(
        () => finish(new OutcomeTimeout(id, timeoutMs, last, published)),
        timeoutMs,
      );
      this.producer
        .send({
          topic: `${this.topicPrefix}intents`,
          acks: -1,
          messages: [
            {
              key: runId,
              value: JSON.stringify(event),
              headers: replyHeaders(this.destination, correlationId),
            },
          ],
        })
        .then(
          () => {
            published = true;
          },
          (err: unknown) => finish(new PublishFailed(id, err)),
        );
    });
  }
}

function traced(traceparent: string | undefined): { traceparent?: string } {
  return traceparent !== undefined ? { traceparent } : {};
}

/** One run of an agent: its steps, and the operations that end it. */
export class Run {
  /** @internal */
  constructor(
    private readonly tally: Tally,
    readonly runId: string,
    readonly tenant: string | undefined,
  ) {}

  /**
   * Publishes a `tally.intent.v1` for this step and resolves with its final answer.
   *
   * Waits through UNKNOWN, AWAITING_APPROVAL, STUCK, PLANNED and DISPATCHING answers (unless
   * `first`) until CONFIRMED (or DUPLICATE, which counts as confirmed) resolves, or FAILED
   * (EffectFailed), CONFLICT (EffectConflict), REJECTED (EffectRejected), CANCELLED
   * (EffectCancelled), a refusal (IntentRefused) or the timeout (OutcomeTimeout) rejects.
   * Calling it again with the same step, tool and arguments, from this process or another, is
   * answered with the same effect (`replay: true`) and does not call the tool again.
   */
  call(
    step: Step,
    tool: string,
    args: Record<string, unknown>,
    options: CallOptions = {},
  ): Promise<Outcome> {
    const data: Record<string, unknown> = { run_id: this.runId, step, tool, args };
    if (options.operationKey !== undefined) data.operation_key = options.operationKey;
    if (this.tenant !== undefined) data.tenant = this.tenant;
    if (options.traceparent !== undefined) data.traceparent = options.traceparent;
    const first = options.first ?? false;
    return this.tally.request<Outcome>(
      "tally.intent.v1",
      this.runId,
      data,
      options.timeoutMs ?? 30000,
      (id) => (ev, history) => judgeIntentAnswer(ev, id, history, first),
    );
  }

  /** Publishes `tally.compensate_run.v1` and resolves with the compensation's end:
   * `tally.run.compensated.v1` (COMPENSATED, PARTIALLY_COMPENSATED) or `tally.run.stuck.v1`
   * (a human must finish it). */
  compensate(options: CompensateOptions = {}): Promise<RunOutcome> {
    const reason = options.reason ?? `compensate_run from ${this.tally.agent}`;
    return this.runMessage(
      "tally.compensate_run.v1",
      { reason, ...traced(options.traceparent) },
      options.timeoutMs ?? 60000,
      ["compensated", "stuck"],
    );
  }

  /** Publishes `tally.cancel_run.v1`: effects not yet dispatched are cancelled. Resolves with
   * `tally.run.cancelled.v1`, or with `compensate`, with the compensation's end. */
  cancel(options: CancelOptions = {}): Promise<RunOutcome> {
    const reason = options.reason ?? `cancel_run from ${this.tally.agent}`;
    const compensate = options.compensate ?? false;
    return this.runMessage(
      "tally.cancel_run.v1",
      { reason, compensate, ...traced(options.traceparent) },
      options.timeoutMs ?? 60000,
      compensate ? ["compensated", "stuck"] : ["cancelled"],
    );
  }

  /** Publishes `tally.complete_run.v1` and resolves with `tally.run.completed.v1` (its summary
   * lists the effects still waiting for a human). Later intents of the run are refused with
   * reason `run_not_active`. */
  complete(options: CompleteOptions = {}): Promise<RunOutcome> {
    const extra = {
      ...(options.reason !== undefined ? { reason: options.reason } : {}),
      ...traced(options.traceparent),
    };
    return this.runMessage("tally.complete_run.v1", extra, options.timeoutMs ?? 30000, [
      "completed",
    ]);
  }

  private runMessage(
    type: string,
    extra: Record<string, unknown>,
    timeoutMs: number,
    wanted: string[],
  ): Promise<RunOutcome> {
    return this.tally.request<RunOutcome>(
      type,
      this.runId,
      { run_id: this.runId, ...extra },
      timeoutMs,
      (id) => (ev, history) => judgeRunAnswer(ev, id, history, wanted),
    );
  }
}
