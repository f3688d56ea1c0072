/* ledger.h — the state machines of the ledger (effects, obligations, runs, alerts).
 *
 * They are declared once, in schemas/machines.json; scripts/gen_machines.py generates from it
 * tally/machines.h (the enums, tally_transition_t and the functions below, per machine: name,
 * parse, terminal, transition_allowed, creation_allowed), the tables in ledger.c, and the SQL
 * triggers `tally migrate` installs, which refuse any other status change in the database.
 * docs/machines.md draws them. */
#ifndef TALLY_LEDGER_H
#define TALLY_LEDGER_H

#include <stdbool.h>

#include "tally/machines.h"

/**
 * SQL: whether an attempt of the effect row aliased @p E may have taken effect, with nothing
 * since to say it did not. An attempt may have when it was sent and its answer never came or
 * was a 5xx (its connector_call event's "verdict" is "unknown"; an idempotent tool's such
 * attempt is retried with the same key, so the effect can be PLANNED again); what says
 * otherwise is a later status check that found nothing (the reconciler's "redispatched"
 * decision). A run that stops must not call such an effect CANCELLED ("never applied").
 * Reads the run's events through their (run_id, seq) index; meant for rare paths.
 */
#define TALLY_SQL_MAYBE_APPLIED(E)                                                                 \
    "EXISTS (SELECT 1 FROM events mu WHERE mu.run_id = " E ".run_id"                               \
    " AND mu.effect_id = " E ".effect_id AND mu.kind = 'connector_call'"                           \
    " AND mu.data->>'op' = 'execute' AND mu.data->>'verdict' = 'unknown'"                          \
    " AND NOT EXISTS (SELECT 1 FROM events mn WHERE mn.run_id = " E ".run_id"                      \
    "   AND mn.effect_id = " E ".effect_id AND mn.kind = 'connector_call'"                         \
    "   AND mn.data->>'op' = 'status' AND mn.data->>'decision' = 'redispatched'"                   \
    "   AND mn.seq > mu.seq))"

/**
 * The receipt is stored once, on the effect (issue 27). A "connector_call" event whose answer
 * became the effect's receipt keeps, in place of the answer, a reference to it and its hash:
 * "receipt": {"on": "effect", "sha256": <hex>} (and "sealed_sha256" for a sensitive tool's
 * sealed receipt); schemas/README.md. Other attempts keep their answer ("response") as before.
 */
#define TALLY_RECEIPT_ON_EFFECT "effect"

/**
 * SQL: the SHA-256 (lowercase hex) of the receipt of the effect row aliased @p E as the ledger
 * keeps it: the text PostgreSQL gives back for the jsonb column (receipt::text, in UTF-8), the
 * bytes every reader gets. jsonb keeps no bytes of what was sent, so this is the exact stored
 * form; NULL when the effect has no receipt.
 */
#define TALLY_SQL_RECEIPT_SHA256(E) "encode(sha256(convert_to(" E ".receipt::text, 'UTF8')), 'hex')"

/** SQL: the SHA-256 (lowercase hex) of the sealed receipt bytes of @p E; NULL when none. */
#define TALLY_SQL_SEALED_SHA256(E) "encode(sha256(" E ".receipt_sealed), 'hex')"

/** The SQLSTATE of a status change the database refused because it is not in its machine. */
#define TALLY_SQLSTATE_ILLEGAL_MOVE "23514"

/** @brief What `tally prune` leaves in effects.args_canonical (and receipt) of a pruned run. */
#define TALLY_PRUNED_MARKER "{\"tally_pruned\":true}"

#endif
