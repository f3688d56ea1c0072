# systemd's service notifications (common/src/notify.c): the socket address and watchdog rules,
# and the datagrams a worker's phases send, received on a socket the test binds.
tally_unit_test(test_notify SOURCES notify.c log.c id.c)
