// Pure decisions about answers: what an answer means for the call waiting on it. No Kafka here,
// so the rules read (and test) as a table.
import {
  EffectCancelled,
  EffectConflict,
  EffectFailed,
  EffectRejected,
  IntentRefused,
  TallyError,
} from "./errors";
import type {
  CloudEvent,
  EffectEventData,
  EffectStatus,
  Outcome,
  RejectionData,
  RunEventData,
  RunOutcome,
} from "./types";

export const INTENT_REJECTED = "tally.intent.rejected.v1";

/** What a call does with one more answer. */
export type Verdict<T> =
  | { kind: "wait" } // not for this call, or not final: keep waiting
  | { kind: "resolve"; value: T }
  | { kind: "reject"; error: TallyError };

/** `confirmed` from `tally.effect.confirmed.v1`; null when the type is not `<family>.*.v1`. */
export function kindOf(type: unknown, family: "tally.effect." | "tally.run."): string | null {
  if (typeof type !== "string" || !type.startsWith(family) || !type.endsWith(".v1")) return null;
  const kind = type.slice(family.length, -".v1".length);
  return kind.length > 0 && !kind.includes(".") ? kind : null;
}

/** The effect states after which nothing more happens to the effect without a human or a
 * compensation: CONFIRMED (and DUPLICATE, which counts as confirmed), FAILED, CONFLICT,
 * REJECTED, CANCELLED. The others (PLANNED, DISPATCHING, UNKNOWN, AWAITING_APPROVAL, STUCK) are
 * answers on the way to one of these. */
const FINAL_BY_KIND: Record<string, EffectStatus> = {
  confirmed: "CONFIRMED",
  duplicate: "CONFIRMED",
  failed: "FAILED",
  conflict: "CONFLICT",
  rejected: "REJECTED",
  cancelled: "CANCELLED",
};
const FINAL_STATUSES = new Set<string>([
  "CONFIRMED",
  "FAILED",
  "CONFLICT",
  "REJECTED",
  "CANCELLED",
]);

/** Whether an effect event is final. Decided on the type (docs/agents.md: "switch on the
 * type"); `compensated` and kinds this client does not know yet fall back to data.status. */
export function isFinal(kind: string, status: unknown): boolean {
  if (kind in FINAL_BY_KIND) return true;
  if (kind === "compensated" || !KNOWN_KINDS.has(kind))
    return typeof status === "string" && FINAL_STATUSES.has(status);
  return false;
}
const KNOWN_KINDS = new Set([
  "confirmed",
  "duplicate",
  "failed",
  "conflict",
  "rejected",
  "cancelled",
  "unknown",
  "awaiting_approval",
  "stuck",
  "planned",
  "dispatching",
  "compensated",
]);

function str(v: unknown): string | null {
  return typeof v === "string" ? v : null;
}

export function toOutcome(
  ev: CloudEvent<EffectEventData>,
  kind: string,
  intentId: string,
  history: CloudEvent[],
): Outcome {
  const d = ev.data;
  return {
    type: ev.type,
    kind,
    status: d.status,
    final: isFinal(kind, d.status),
    effectId: str(d.effect_id),
    runId: d.run_id,
    step: d.step,
    tool: d.tool,
    operationKey: str(d.operation_key),
    receipt: d.receipt && typeof d.receipt === "object" ? d.receipt : null,
    externalRef: str(d.external_ref),
    attempts: typeof d.attempts === "number" ? d.attempts : 0,
    replay: d.replay === true,
    error: d.error && typeof d.error === "object" ? d.error : null,
    // the id this client published, also when a later event of the effect names the intent
    // that created it
    intentId,
    event: ev,
    history: history.slice(),
  };
}

export function toRunOutcome(
  ev: CloudEvent<RunEventData>,
  kind: string,
  intentId: string,
  history: CloudEvent[],
): RunOutcome {
  const d = ev.data;
  return {
    type: ev.type,
    kind,
    runId: d.run_id,
    status: d.status,
    reason: str(d.reason),
    summary: d.summary && typeof d.summary === "object" ? d.summary : null,
    effectsCancelled: typeof d.effects_cancelled === "number" ? d.effects_cancelled : null,
    intentId,
    event: ev,
    history: history.slice(),
  };
}

export function refusal(ev: CloudEvent<RejectionData>, intentId: string): IntentRefused {
  const d = ev.data ?? ({} as RejectionData);
  return new IntentRefused(
    intentId,
    str(d.reason) ?? "unknown",
    str(d.field),
    str(d.detail) ?? "(no detail)",
    ev,
  );
}

function hasData(ev: CloudEvent): boolean {
  return ev.data !== null && typeof ev.data === "object" && !Array.isArray(ev.data);
}

/** The verdict of one more answer to a `tally.intent.v1`: a refusal rejects, a final effect
 * event resolves (CONFIRMED, DUPLICATE) or rejects (the others), and any other effect event is
 * waited through unless `first` asks for the first answer as it is. */
export function judgeIntentAnswer(
  ev: CloudEvent,
  intentId: string,
  history: CloudEvent[],
  first: boolean,
): { verdict: Verdict<Outcome>; outcome?: Outcome } {
  if (!hasData(ev)) return { verdict: { kind: "wait" } };
  if (ev.type === INTENT_REJECTED)
    return {
      verdict: { kind: "reject", error: refusal(ev as CloudEvent<RejectionData>, intentId) },
    };
  const kind = kindOf(ev.type, "tally.effect.");
  if (kind === null) return { verdict: { kind: "wait" } };
  const o = toOutcome(ev as CloudEvent<EffectEventData>, kind, intentId, history);
  if (!o.final)
    return { verdict: first ? { kind: "resolve", value: o } : { kind: "wait" }, outcome: o };
  switch (FINAL_BY_KIND[kind] ?? o.status) {
    case "CONFIRMED":
      return { verdict: { kind: "resolve", value: o }, outcome: o };
    case "FAILED":
      return { verdict: { kind: "reject", error: new EffectFailed(o) }, outcome: o };
    case "CONFLICT":
      return { verdict: { kind: "reject", error: new EffectConflict(o) }, outcome: o };
    case "REJECTED":
      return { verdict: { kind: "reject", error: new EffectRejected(o) }, outcome: o };
    default:
      return { verdict: { kind: "reject", error: new EffectCancelled(o) }, outcome: o };
  }
}

/** The verdict of one more answer to a run message: a refusal rejects; a `tally.run.<kind>.v1`
 * whose kind is one of `wanted` resolves; every other event (an earlier operation's, an
 * effect's) is waited through. */
export function judgeRunAnswer(
  ev: CloudEvent,
  intentId: string,
  history: CloudEvent[],
  wanted: readonly string[],
): { verdict: Verdict<RunOutcome>; outcome?: RunOutcome } {
  if (!hasData(ev)) return { verdict: { kind: "wait" } };
  if (ev.type === INTENT_REJECTED)
    return {
      verdict: { kind: "reject", error: refusal(ev as CloudEvent<RejectionData>, intentId) },
    };
  const kind = kindOf(ev.type, "tally.run.");
  if (kind === null) return { verdict: { kind: "wait" } };
  const o = toRunOutcome(ev as CloudEvent<RunEventData>, kind, intentId, history);
  return {
    verdict: wanted.includes(kind) ? { kind: "resolve", value: o } : { kind: "wait" },
    outcome: o,
  };
}
