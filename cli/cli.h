/* cli.h — the verbs of the `tally` operator command. main.c dispatches; one file per group. */
#ifndef TALLY_CLI_H
#define TALLY_CLI_H

#include "tally/config.h"

/**
 * Every verb: argv[0] is the verb itself ("migrate"), the rest its options; @p cfg is the
 * environment's configuration (owned by main). Returns the process exit code: 0 success,
 * 1 a problem found or refused, 2 usage error, 3 could not reach PostgreSQL/Kafka — unless
 * the verb documents its own (status: 0 clean, 1 aging UNKNOWN, 2 STUCK; publish: 1 the
 * command failed, 2 usage, 3-8 what the answer was, cmd_publish.c PUB_EXIT_*; verify: 0 clean,
 * 1 findings, 2 could not check).
 * Each verb answers --help with its options.
 */
typedef int (*tally_cmd_fn)(int argc, char **argv, tally_config_t *cfg);

int tally_cmd_migrate(int argc, char **argv, tally_config_t *cfg); /* cmd_migrate.c */
int tally_cmd_tools(int argc, char **argv, tally_config_t *cfg); /* cmd_tools.c: tools check FILE */
int tally_cmd_publish(int argc, char **argv, tally_config_t *cfg);     /* cmd_publish.c */
int tally_cmd_dev(int argc, char **argv, tally_config_t *cfg);         /* cmd_dev.c, dev.h */
int tally_cmd_config(int argc, char **argv, tally_config_t *cfg);      /* main.c */
int tally_cmd_status(int argc, char **argv, tally_config_t *cfg);      /* cmd_status.c */
int tally_cmd_doctor(int argc, char **argv, tally_config_t *cfg);      /* cmd_doctor.c */
int tally_cmd_run_summary(int argc, char **argv, tally_config_t *cfg); /* cmd_summary.c */
int tally_cmd_resolve(int argc, char **argv, tally_config_t *cfg);     /* cmd_resolve.c */
int tally_cmd_approve(int argc, char **argv, tally_config_t *cfg);     /* cmd_resolve.c */
int tally_cmd_deny(int argc, char **argv, tally_config_t *cfg);        /* cmd_resolve.c */
int tally_cmd_compensate(int argc, char **argv, tally_config_t *cfg);  /* cmd_run.c */
int tally_cmd_cancel(int argc, char **argv, tally_config_t *cfg);      /* cmd_run.c */
int tally_cmd_forget(int argc, char **argv, tally_config_t *cfg);      /* cmd_forget.c */
int tally_cmd_prune(int argc, char **argv, tally_config_t *cfg);       /* cmd_prune.c */
int tally_cmd_verify(int argc, char **argv, tally_config_t *cfg);      /* cmd_verify.c */

/** The OS user, for --actor defaults. Never NULL. */
const char *tally_cli_default_actor(void);

#endif
