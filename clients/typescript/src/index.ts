// @tally/client: publish intents to tally and await their outcomes (docs/agent-protocol.md).
export { Tally, Run } from "./client";
export {
  TallyError,
  EffectFailed,
  EffectConflict,
  EffectRejected,
  EffectCancelled,
  IntentRefused,
  OutcomeTimeout,
  PublishFailed,
  TallyClosed,
} from "./errors";
export { isFinal, judgeIntentAnswer, judgeRunAnswer, INTENT_REJECTED } from "./answers";
export type { Verdict } from "./answers";
export {
  checkDestination,
  correlationOf,
  defaultReplyTopic,
  replyHeaders,
  sanitizeAgent,
  ReplyRouter,
  HEADER_CORRELATION_ID,
  HEADER_REPLY_PARTITION,
  HEADER_REPLY_TOPIC,
} from "./replies";
export type { ReplyDestination, Waiter } from "./replies";
export type * from "./types";
