// The ways a call can end other than CONFIRMED. Each carries what tally said: the outcome (or
// the refusal) and a machine-readable code, so an agent can switch on the class or the code.
import type { CloudEvent, Outcome, RejectionData, RunOutcome } from "./types";

/** The base of every error this client raises on purpose. */
export class TallyError extends Error {
  /** machine-readable: the effect's error code, the refusal's reason, `timeout`, ... */
  readonly code: string;
  /** the answer that ended the call, when there was one */
  readonly outcome: Outcome | RunOutcome | undefined;

  constructor(code: string, message: string, outcome?: Outcome | RunOutcome, cause?: unknown) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = new.target.name;
    this.code = code;
    this.outcome = outcome;
  }
}

function describe(o: Outcome, what: string): string {
  const why = o.error ? `: ${o.error.code}: ${o.error.message}` : "";
  return `step ${JSON.stringify(o.step)} (${o.tool}) of run ${o.runId} ${what}${why}`;
}

/** The tool refused (a 4xx) or the retries ran out: nothing happened (`tally.effect.failed.v1`). */
export class EffectFailed extends TallyError {
  declare readonly outcome: Outcome;
  constructor(o: Outcome) {
    super(o.error?.code ?? "failed", describe(o, "failed"), o);
  }
}

/** The intent reused an operation key or a step that belongs to an effect with other
 * arguments; nothing was called (`tally.effect.conflict.v1`). A bug in the agent's plan. */
export class EffectConflict extends TallyError {
  declare readonly outcome: Outcome;
  constructor(o: Outcome) {
    super(o.error?.code ?? "conflict", describe(o, "conflicts with an existing effect"), o);
  }
}

/** A human denied the effect (`tally deny`; `tally.effect.rejected.v1`). */
export class EffectRejected extends TallyError {
  declare readonly outcome: Outcome;
  constructor(o: Outcome) {
    super(o.error?.code ?? "rejected", describe(o, "was rejected by an approver"), o);
  }
}

/** The effect was cancelled before it was applied: its run was cancelled or stopped
 * (`tally.effect.cancelled.v1`; code `run_not_active` for a call stopped in flight). */
export class EffectCancelled extends TallyError {
  declare readonly outcome: Outcome;
  constructor(o: Outcome) {
    super(o.error?.code ?? "cancelled", describe(o, "was cancelled"), o);
  }
}

/** tally refused the message itself (`tally.intent.rejected.v1`): nothing was recorded or
 * called. `reason` is the DLQ's reason (`unknown_tool`, `invalid_field`, ...) or
 * `run_not_active` (the run is completed, compensated or cancelled). */
export class IntentRefused extends TallyError {
  readonly reason: string;
  /** the field at fault (`data.tool`, `replytopic`), or null */
  readonly field: string | null;
  readonly detail: string;
  /** the refused message's CloudEvents id */
  readonly intentId: string;
  /** the refusal as tally sent it; undefined when this client refused the message before
   * sending it (a reply destination tally would refuse: see `local`) */
  readonly event: CloudEvent<RejectionData> | undefined;
  /** true when the client refused the message itself and nothing was published */
  readonly local: boolean;

  constructor(
    intentId: string,
    reason: string,
    field: string | null,
    detail: string,
    event?: CloudEvent<RejectionData>,
  ) {
    super(
      reason,
      `tally refused message ${intentId}: ${reason}${field ? ` (${field})` : ""}: ${detail}`,
    );
    this.reason = reason;
    this.field = field;
    this.detail = detail;
    this.intentId = intentId;
    this.event = event;
    this.local = event === undefined;
  }
}

/** No final answer within the time asked. The effect may still complete: `lastAnswer` is the
 * last answer seen (UNKNOWN, AWAITING_APPROVAL, STUCK, ...) or undefined when none came.
 * Publishing the same intent again later is safe: it is answered with the same effect. */
export class OutcomeTimeout extends TallyError {
  readonly lastAnswer: Outcome | RunOutcome | undefined;
  readonly timeoutMs: number;
  readonly intentId: string;
  /** whether Kafka had acknowledged the message by then */
  readonly published: boolean;

  constructor(
    intentId: string,
    timeoutMs: number,
    lastAnswer: Outcome | RunOutcome | undefined,
    published: boolean,
  ) {
    const last = lastAnswer
      ? `; the last answer was ${lastAnswer.type} (${lastAnswer.status})`
      : published
        ? "; no answer came"
        : "; Kafka had not acknowledged it yet";
    super("timeout", `no final answer to ${intentId} within ${timeoutMs} ms${last}`, lastAnswer);
    this.lastAnswer = lastAnswer;
    this.timeoutMs = timeoutMs;
    this.intentId = intentId;
    this.published = published;
  }
}

/** Kafka did not acknowledge the message. It may still have landed: sending the same intent
 * again is safe (same tool, operation key and arguments are the same effect). */
export class PublishFailed extends TallyError {
  readonly intentId: string;
  constructor(intentId: string, cause: unknown) {
    const why = cause instanceof Error ? cause.message : String(cause);
    super(
      "publish_failed",
      `Kafka did not acknowledge message ${intentId}: ${why}`,
      undefined,
      cause,
    );
    this.intentId = intentId;
  }
}

/** The client was closed (or its reply reader stopped) while the call waited. */
export class TallyClosed extends TallyError {
  constructor(message = "the tally client is closed", cause?: unknown) {
    super("closed", message, undefined, cause);
  }
}
