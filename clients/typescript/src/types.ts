// The shapes of tally's messages as this client reads them (schemas/*.schema.json) and of the
// client's own options. Every answer also keeps its raw CloudEvent: fields tally adds later are
// there before this file names them.
import type { ConsumerConfig, KafkaConfig, ProducerConfig } from "kafkajs";

/** A CloudEvents 1.0 event in structured JSON mode, as tally sends and reads them. */
export interface CloudEvent<D = Record<string, unknown>> {
  specversion: string;
  id: string;
  source: string;
  type: string;
  time?: string;
  datacontenttype?: string;
  subject?: string;
  data: D;
  /** extension attributes (`correlationid` on a reply) */
  [attribute: string]: unknown;
}

/** A step: a non-negative integer (orders compensation, last step first) or a string. */
export type Step = number | string;

/** The states of an effect in the ledger, and CONFLICT for an intent refused as one. */
export type EffectStatus =
  | "PLANNED"
  | "AWAITING_APPROVAL"
  | "DISPATCHING"
  | "CONFIRMED"
  | "FAILED"
  | "UNKNOWN"
  | "STUCK"
  | "REJECTED"
  | "CANCELLED"
  | "CONFLICT";

export interface EffectError {
  /** machine-readable: `http_422`, `timeout`, `conflict`, `run_not_active`, ... */
  code: string;
  message: string;
}

/** `data` of a `tally.effect.*.v1` event (schemas/effect_event.schema.json). */
export interface EffectEventData {
  effect_id: string | null;
  run_id: string;
  step: Step;
  tool: string;
  operation_key: string | null;
  status: EffectStatus;
  receipt: Record<string, unknown> | null;
  external_ref: string | null;
  error: EffectError | null;
  attempts: number;
  intent_id: string;
  replay?: boolean;
  [field: string]: unknown;
}

/** One answer about the effect an intent created or found, as `Run.call` returns it. */
export interface Outcome {
  /** `tally.effect.confirmed.v1`, `.failed.v1`, `.unknown.v1`, ... */
  type: string;
  /** the middle of the type: `confirmed`, `failed`, `unknown`, `duplicate`, ... */
  kind: string;
  /** the effect's state in the ledger when the event was written */
  status: EffectStatus;
  /** whether this answer is the effect's last word (see `isFinal`) */
  final: boolean;
  effectId: string | null;
  runId: string;
  step: Step;
  tool: string;
  operationKey: string | null;
  /** the tool's own answer (a JSON object) when it did the work, else null */
  receipt: Record<string, unknown> | null;
  /** the identifier taken from the receipt (a charge id), or null */
  externalRef: string | null;
  /** connector calls made so far */
  attempts: number;
  /** true when the intent found an effect that already existed (a republished intent) */
  replay: boolean;
  error: EffectError | null;
  /** the CloudEvents id of the intent this client published */
  intentId: string;
  /** the raw CloudEvent of this answer */
  event: CloudEvent<EffectEventData>;
  /** every answer to the call up to and including this one, oldest first */
  history: CloudEvent[];
}

/** `data` of `tally.intent.rejected.v1` (docs/agent-protocol.md, "Every intent is answered"). */
export interface RejectionData {
  intent_id: string;
  run_id: string;
  step: Step | null;
  tool: string | null;
  type: string | null;
  status: "REJECTED";
  /** a DLQ reason (`unknown_tool`, `invalid_field`, `invalid_reply_to`, ...) or `run_not_active` */
  reason: string;
  /** the field at fault (`data.tool`, `replytopic`) or null */
  field: string | null;
  detail: string;
  /** where the original message is in `<prefix>intents`; null for `run_not_active` */
  dlq: { topic: string; partition: number; offset: number } | null;
  [field_: string]: unknown;
}

/** An effect of a run that is still waiting for something (a human, the reconciler). */
export interface OpenEffect {
  effect_id: string;
  step: Step;
  tool: string;
  status: EffectStatus;
}

/** `data.summary` of `tally.run.completed.v1`. */
export interface CompletionSummary {
  total: number;
  /** effects by status: `{"CONFIRMED": 3}` */
  effects: Record<string, number>;
  /** at most 100 */
  open: OpenEffect[];
  open_count: number;
  [field: string]: unknown;
}

/** One effect in a compensation summary. */
export interface SummaryItem {
  effect_id: string;
  step: Step;
  tool: string;
  obligation_id?: string | null;
  external_ref?: string | null;
  reverse_receipt?: Record<string, unknown> | null;
  blast_radius?: Record<string, unknown> | null;
  reason?: string | null;
  error?: EffectError | null;
  action_required?: string | null;
  [field: string]: unknown;
}

/** `data.summary` of `tally.run.compensated.v1` / `tally.run.stuck.v1` (DESIGN §7). */
export interface CompensationSummary {
  compensated: SummaryItem[];
  uncompensatable: SummaryItem[];
  skipped: SummaryItem[];
  failed: SummaryItem[];
  [field: string]: unknown;
}

/** `data` of a `tally.run.*.v1` event. */
export interface RunEventData {
  run_id: string;
  /** COMPENSATED, PARTIALLY_COMPENSATED, STUCK, CANCELLED, COMPLETED */
  status: string;
  reason?: string | null;
  summary?: CompensationSummary | CompletionSummary | null;
  effects_cancelled?: number;
  [field: string]: unknown;
}

/** How a run operation ended: `compensate`, `cancel` and `complete` resolve with it. */
export interface RunOutcome {
  /** `tally.run.compensated.v1`, `.stuck.v1`, `.cancelled.v1`, `.completed.v1` */
  type: string;
  /** `compensated`, `stuck`, `cancelled`, `completed` */
  kind: string;
  runId: string;
  /** COMPENSATED, PARTIALLY_COMPENSATED, STUCK, CANCELLED, COMPLETED */
  status: string;
  reason: string | null;
  /** the compensation summary (compensated, stuck) or the completion summary (completed) */
  summary: CompensationSummary | CompletionSummary | null;
  /** for `cancelled`: how many effects not yet dispatched were cancelled */
  effectsCancelled: number | null;
  /** the CloudEvents id of the run message this client published */
  intentId: string;
  event: CloudEvent<RunEventData>;
  history: CloudEvent[];
}

export interface TallyOptions {
  /** bootstrap brokers, `host:port` */
  brokers: string[];
  /** the agent's name: in the CloudEvents `source` and the default reply topic's name */
  agent: string;
  /** the deployment's TALLY_TOPIC_PREFIX; default `tally.` */
  topicPrefix?: string;
  /** the prefix tally accepts reply topics under (TALLY_REPLY_TOPIC_PREFIX); default
   * `<topicPrefix>replies.` */
  replyTopicPrefix?: string;
  /** an existing topic for this process's answers, instead of a topic of its own; it is read
   * from its end, and answers are told apart by their correlation id */
  replyTopic?: string;
  /** with `replyTopic`: the one partition tally answers to, and the only one read */
  replyPartition?: number;
  /** the CloudEvents `source` of every message; default `/agents/<agent>` */
  source?: string;
  /** kafkajs client settings (ssl, sasl, clientId, logLevel, ...), over this client's own */
  kafka?: Partial<KafkaConfig>;
  /** kafkajs producer settings, over this client's own */
  producer?: Partial<ProducerConfig>;
  /** kafkajs consumer settings of the reply reader (sessionTimeout, maxWaitTimeInMs, ...) */
  consumer?: Partial<ConsumerConfig>;
  /** use Kafka's idempotent producer; default true. A cluster without a controller
   * (librdkafka's mock cluster, which `tally dev` runs) cannot start one: the client then
   * says so in a warning and uses a plain producer */
  idempotent?: boolean;
  /** how long `connect` may take to be ready to read answers; default 60000 */
  connectTimeoutMs?: number;
}

export interface RunOptions {
  /** `data.tenant` of every intent of the run (at most 200 bytes) */
  tenant?: string;
}

export interface CallOptions {
  /** how long the call may take in all — the publish, then the wait for the final answer;
   * default 30000 */
  timeoutMs?: number;
  /** resolve with the first answer even when it is not final (UNKNOWN, AWAITING_APPROVAL, ...) */
  first?: boolean;
  /** the idempotency key, for a tool whose contract does not build one from the args */
  operationKey?: string;
  /** W3C traceparent sent to the tool with every call for this effect */
  traceparent?: string;
}

export interface CompensateOptions {
  /** why, for the audit trail; default `compensate_run from <agent>` */
  reason?: string;
  /** default 60000 */
  timeoutMs?: number;
  /** W3C traceparent, stored with the run's request */
  traceparent?: string;
}

export interface CancelOptions {
  reason?: string;
  /** also compensate the run's confirmed effects, and wait for the compensation summary */
  compensate?: boolean;
  /** default 60000 */
  timeoutMs?: number;
  /** W3C traceparent, stored with the run's request */
  traceparent?: string;
}

export interface CompleteOptions {
  reason?: string;
  /** default 30000 */
  timeoutMs?: number;
  /** W3C traceparent, stored with the run's request */
  traceparent?: string;
}

/** What the reply reader has seen: `messagesRead` counts every message read from the reply
 * topic, `answersReceived` the distinct answers to this process's own messages still waited
 * for; the rest are `duplicates` (an answer delivered again), `late` (an answer to a call that
 * already ended), `foreign` (another client's, on a shared reply topic) and `unreadable`. */
export interface TallyStats {
  messagesRead: number;
  answersReceived: number;
  duplicates: number;
  late: number;
  foreign: number;
  unreadable: number;
}
