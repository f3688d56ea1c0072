# Sensitive fields (common/src/seal.c): master keys from the environment, tenant keys wrapped and
# opened, AES-256-GCM sealing bound to its row and field, redaction markers and scrubbing.
tally_unit_test(test_seal SOURCES seal.c json.c id.c error.c config.c)
