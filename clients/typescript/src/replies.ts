// Reply destinations (docs/agent-protocol.md, "Reply destinations"): the Spring Kafka headers
// every message carries, the checks tally makes on them, and the router that hands each reply
// read from the reply topic to the call waiting for it, by correlation id.
import type { IHeaders, KafkaMessage } from "kafkajs";
import type { CloudEvent, TallyStats } from "./types";

export const HEADER_REPLY_TOPIC = "kafka_replyTopic";
export const HEADER_REPLY_PARTITION = "kafka_replyPartition";
export const HEADER_CORRELATION_ID = "kafka_correlationId";

const TOPIC_CHARS = /^[A-Za-z0-9._-]+$/;
const MAX_TOPIC_BYTES = 249;
const MAX_PARTITION = 2147483647;

export interface ReplyDestination {
  topic: string;
  /** absent: tally answers to the partition of the run id, as on `<prefix>outcomes` */
  partition?: number;
}

/** The agent's name as it may appear in a topic name: runs of other characters become `-`. */
export function sanitizeAgent(agent: string): string {
  const s = agent.replace(/[^A-Za-z0-9._-]+/g, "-").replace(/^[-.]+|[-.]+$/g, "");
  return (s || "agent").slice(0, 100);
}

/** `<replyPrefix><agent>.<16 hex>`: a topic of this process's own. */
export function defaultReplyTopic(replyPrefix: string, agent: string, hex16: string): string {
  const room = MAX_TOPIC_BYTES - replyPrefix.length - 1 - hex16.length;
  return `${replyPrefix}${sanitizeAgent(agent).slice(0, Math.max(room, 1))}.${hex16}`;
}

/** Why tally would refuse this destination (reason `invalid_reply_to`), or null when it would
 * not. The same checks as the dispatcher's, so a message tally would refuse is never sent:
 * tally answers such a refusal on `<prefix>outcomes` only, where this client is not reading. */
export function checkDestination(
  dest: ReplyDestination,
  allowedPrefix: string,
): { field: string; detail: string } | null {
  const t = dest.topic;
  if (Buffer.byteLength(t, "utf8") < 1 || Buffer.byteLength(t, "utf8") > MAX_TOPIC_BYTES)
    return { field: "replytopic", detail: `the reply topic must be 1 to ${MAX_TOPIC_BYTES} bytes` };
  if (!TOPIC_CHARS.test(t))
    return {
      field: "replytopic",
      detail: `the reply topic '${t}' has characters outside [A-Za-z0-9._-]`,
    };
  if (!t.startsWith(allowedPrefix))
    return {
      field: "replytopic",
      detail:
        `the reply topic '${t}' does not start with the allowed prefix '${allowedPrefix}' ` +
        "(TALLY_REPLY_TOPIC_PREFIX; give the client the replyTopicPrefix option if it differs)",
    };
  const p = dest.partition;
  if (p !== undefined && !(Number.isInteger(p) && p >= 0 && p <= MAX_PARTITION))
    return {
      field: "replypartition",
      detail: `the reply partition must be an integer from 0 to ${MAX_PARTITION}`,
    };
  return null;
}

/** The headers of a message whose answers go to `dest`, matched by `correlationId`. Spring's
 * encodings: the topic as UTF-8 text, the partition as a 4-byte big-endian int32, the
 * correlation id as bytes (here the UTF-8 of a random UUID). */
export function replyHeaders(dest: ReplyDestination, correlationId: string): IHeaders {
  const headers: IHeaders = {
    "content-type": "application/cloudevents+json",
    [HEADER_REPLY_TOPIC]: Buffer.from(dest.topic, "utf8"),
    [HEADER_CORRELATION_ID]: Buffer.from(correlationId, "utf8"),
  };
  if (dest.partition !== undefined) {
    const b = Buffer.alloc(4);
    b.writeInt32BE(dest.partition, 0);
    headers[HEADER_REPLY_PARTITION] = b;
  }
  return headers;
}

function header(headers: IHeaders | undefined, name: string): Buffer | string | undefined {
  const v = headers?.[name];
  return Array.isArray(v) ? v[0] : v;
}

/** The correlation id of a reply: the `kafka_correlationId` header, else the CloudEvents
 * attribute `correlationid` (or `correlationidbase64`, for bytes that are not text). */
export function correlationOf(headers: IHeaders | undefined, ev: CloudEvent | null): string | null {
  const h = header(headers, HEADER_CORRELATION_ID);
  if (h !== undefined) return Buffer.isBuffer(h) ? h.toString("utf8") : String(h);
  if (ev && typeof ev.correlationid === "string") return ev.correlationid;
  if (ev && typeof ev.correlationidbase64 === "string")
    return Buffer.from(ev.correlationidbase64, "base64").toString("utf8");
  return null;
}

/** A call waiting for its answers. */
export interface Waiter {
  /** called once per distinct answer (CloudEvents id), in the order read */
  answer(ev: CloudEvent): void;
}

interface Entry {
  waiter: Waiter;
  seen: Set<string>;
}

/** Hands each reply to the call that sent the message it answers. Calls register their
 * correlation id before the message is sent, so an answer that comes before anyone awaits
 * the call is kept by the call. Duplicates (at-least-once delivery) are dropped per call on
 * the CloudEvents id: two calls that published the same intent each get their own copy. */
export class ReplyRouter {
  private readonly waiting = new Map<string, Entry>();
  /** correlation ids of calls that ended, most recent last (bounded) */
  private readonly ended = new Set<string>();
  private readonly stats_: TallyStats = {
    messagesRead: 0,
    answersReceived: 0,
    duplicates: 0,
    late: 0,
    foreign: 0,
    unreadable: 0,
  };

  static readonly ENDED_KEPT = 4096;

  register(correlationId: string, waiter: Waiter): void {
    this.waiting.set(correlationId, { waiter, seen: new Set() });
  }

  unregister(correlationId: string): void {
    if (!this.waiting.delete(correlationId)) return;
    this.ended.add(correlationId);
    if (this.ended.size > ReplyRouter.ENDED_KEPT) {
      const oldest = this.ended.values().next().value;
      if (oldest !== undefined) this.ended.delete(oldest);
    }
  }

  /** The correlation ids still waited for. */
  pending(): string[] {
    return [...this.waiting.keys()];
  }

  stats(): TallyStats {
    return { ...this.stats_ };
  }

  /** One message read from the reply topic. */
  deliver(message: Pick<KafkaMessage, "headers" | "value">): void {
    this.stats_.messagesRead++;
    let ev: CloudEvent | null = null;
    try {
      const parsed: unknown = JSON.parse(message.value?.toString("utf8") ?? "");
      if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed))
        ev = parsed as CloudEvent;
    } catch {
      ev = null;
    }
    const cid = correlationOf(message.headers, ev);
    if (ev === null || typeof ev.id !== "string" || typeof ev.type !== "string") {
      // not a reply at all: counted as foreign when it names no call of ours
      if (cid !== null && this.waiting.has(cid)) this.stats_.unreadable++;
      else this.stats_.foreign++;
      return;
    }
    const entry = cid === null ? undefined : this.waiting.get(cid);
    if (entry === undefined) {
      if (cid !== null && this.ended.has(cid)) this.stats_.late++;
      else this.stats_.foreign++;
      return;
    }
    if (entry.seen.has(ev.id)) {
      this.stats_.duplicates++;
      return;
    }
    entry.seen.add(ev.id);
    this.stats_.answersReceived++;
    entry.waiter.answer(ev);
  }
}
