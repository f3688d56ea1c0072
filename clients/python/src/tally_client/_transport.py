"""The Kafka side of the client: one idempotent producer for <prefix>intents and one reply
consumer, read by a background thread that hands each answer to the mailbox of the message
it answers (by correlation id). Both the blocking API and the asyncio one sit on this."""

import logging
import threading
import time

from confluent_kafka import (OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer,
                             TopicPartition)
from confluent_kafka.admin import AdminClient, NewTopic

from . import _wire
from .errors import PublishError, TallyError

log = logging.getLogger("tally_client")

# The librdkafka mock cluster (`tally dev`) holds an empty fetch for the whole
# fetch.wait.max.ms (500 ms by default) even when data arrives meanwhile; a real broker
# answers as soon as there is data, so a small value costs a real cluster only idle fetches.
CONSUMER_DEFAULTS = {"fetch.wait.max.ms": 10, "enable.auto.commit": False,
                     "enable.auto.offset.store": False, "enable.partition.eof": False,
                     "auto.offset.reset": "earliest"}
PRODUCER_DEFAULTS = {"enable.idempotence": True, "linger.ms": 1, "message.timeout.ms": 30000}
SETUP_TIMEOUT = 15.0


class Mailbox:
    """The answers to one published message, in arrival order, deduplicated on their
    CloudEvents id. Opened before the message is published, so no early answer is lost.
    `listener` (optional) is called from the consumer thread after each new answer."""

    def __init__(self, correlation_id, listener=None):
        self.correlation_id = correlation_id
        self.listener = listener
        self.answers = []
        self.ids = set()


class Delivery:
    """A produce's delivery report, filled from the producer's polling thread."""

    def __init__(self, on_done=None):
        self.done = threading.Event()
        self.error = None
        self.on_done = on_done

    def report(self, err, msg):
        self.error = err
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class Transport:
    def __init__(self, brokers, agent, *, topic_prefix="tally.", reply_topic=None,
                 reply_partition=None, reply_prefix=None, config=None):
        if not isinstance(agent, str) or not agent:
            raise ValueError("agent must be a non-empty string")
        if reply_partition is not None and reply_topic is None:
            raise ValueError("reply_partition needs reply_topic (a process's own reply topic "
                             "is always read at partition 0)")
        self.brokers = brokers
        self.agent = agent
        self.topic_prefix = topic_prefix
        self.intents_topic = topic_prefix + "intents"
        self.reply_prefix = reply_prefix if reply_prefix is not None else topic_prefix + "replies."
        self.own_topic = reply_topic is None
        self.reply_topic = _wire.private_reply_topic(topic_prefix, agent) if self.own_topic \
            else reply_topic
        # Our own topic is read at partition 0 only, and answers are sent there: that holds
        # whether it was created with one partition or auto-created with the broker's default.
        self.reply_partition = 0 if self.own_topic else reply_partition
        self.refusal = _wire.reply_topic_refusal(self.reply_topic, self.reply_partition,
                                                 self.reply_prefix)
        self.config = dict(config or {})
        self.delivery_timeout = float(self.config.get("message.timeout.ms",
                                                      PRODUCER_DEFAULTS["message.timeout.ms"])) \
            / 1000.0 + 5.0
        self.cond = threading.Condition()
        self._boxes = {}
        self._issued = set()
        self._stats = {"published": 0, "messages_read": 0, "answers": 0, "duplicates": 0,
                       "late": 0, "foreign": 0, "unreadable": 0}
        self._failure = None
        self._stopping = threading.Event()
        self._threads = []
        self._producer = None
        self._consumer = None
        self._created_topic = False
        self._create_error = None
        self._controller = False
        self._started = False

    # --- life cycle --------------------------------------------------------------------

    def _client_config(self, defaults):
        conf = {"bootstrap.servers": self.brokers}
        conf.update(defaults)
        conf.update(self.config)
        return conf

    def start(self):
        """Connect, make sure the reply topic exists, assign the reply consumer and start the
        two background threads. Blocking; raises TallyError when the cluster cannot serve."""
        if self._started:
            return
        try:
            self._producer = Producer(self._client_config(PRODUCER_DEFAULTS))
            self._check_intents_topic()
            if self.own_topic:
                self._create_own_topic()
            # confluent-kafka 1.7 wants a group.id even for assign(); no group is joined and
            # nothing is committed.
            self._consumer = Consumer(self._client_config(dict(
                CONSUMER_DEFAULTS, **{"group.id": "tally-client." + self.reply_topic})))
            self._consumer.assign(self._assignment())
        except KafkaException as e:
            self._close_clients()
            raise TallyError(f"Kafka at {self.brokers}: {e.args[0]}") from None
        except BaseException:
            self._close_clients()
            raise
        for name, target in (("tally-replies", self._read_replies),
                             ("tally-deliveries", self._serve_deliveries)):
            t = threading.Thread(target=target, name=f"{name}-{self.agent}", daemon=True)
            t.start()
            self._threads.append(t)
        self._started = True

    def _check_intents_topic(self):
        """Fails early when tally's intents topic is missing (a wrong topic prefix), and
        warms the producer's metadata so the first publish does not wait for it."""
        md = self._producer.list_topics(topic=self.intents_topic, timeout=SETUP_TIMEOUT)
        tmd = md.topics.get(self.intents_topic)
        err = tmd.error if tmd is not None else None
        if tmd is None or (err is not None and err.code() != KafkaError.LEADER_NOT_AVAILABLE):
            raise TallyError(f"topic {self.intents_topic} is not available "
                             f"({err or 'missing'}): is tally's topic prefix "
                             f"{self.topic_prefix!r}?")

    def _create_own_topic(self):
        """CreateTopics with one partition when the cluster has a controller; otherwise (the
        librdkafka mock cluster has none) the broker's auto-creation, asked for by a metadata
        request for the topic."""
        admin = AdminClient(self._client_config({}))
        md = admin.list_topics(timeout=SETUP_TIMEOUT)
        self._controller = md.controller_id in md.brokers
        if self._controller:
            self._created_topic = self._create_topic(admin, -1) or self._create_topic(admin, 1)
            if not self._created_topic:
                raise TallyError(f"cannot create the reply topic {self.reply_topic}: "
                                 f"{self._create_error}; pass reply_topic= a topic that exists")
        deadline = time.monotonic() + SETUP_TIMEOUT
        while True:
            md = admin.list_topics(topic=self.reply_topic, timeout=SETUP_TIMEOUT)
            tmd = md.topics.get(self.reply_topic)
            if tmd is not None and tmd.error is None and tmd.partitions:
                return
            if time.monotonic() > deadline:
                why = tmd.error if tmd is not None else "missing"
                raise TallyError(f"the reply topic {self.reply_topic} is not available: {why}"
                                 "; pass reply_topic= a topic that exists")
            time.sleep(0.05)

    def _create_topic(self, admin, replication):
        """True when the topic exists now. replication -1 is the broker's default (Kafka
        2.4+); older brokers get 1, which suits a topic that lives as long as a process."""
        fut = admin.create_topics([NewTopic(self.reply_topic, 1, replication)],
                                  request_timeout=SETUP_TIMEOUT)[self.reply_topic]
        try:
            fut.result(SETUP_TIMEOUT)
            return True
        except KafkaException as e:
            if e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return True
            self._create_error = e.args[0]
            return False

    def _assignment(self):
        if self.own_topic:
            return [TopicPartition(self.reply_topic, 0, OFFSET_BEGINNING)]
        md = self._consumer.list_topics(topic=self.reply_topic, timeout=SETUP_TIMEOUT)
        tmd = md.topics.get(self.reply_topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise TallyError(f"the reply topic {self.reply_topic} is not available: "
                             f"{tmd.error if tmd is not None else 'missing'}")
        if self.reply_partition is not None:
            if self.reply_partition not in tmd.partitions:
                raise TallyError(f"the reply topic {self.reply_topic} has no partition "
                                 f"{self.reply_partition}")
            partitions = [self.reply_partition]
        else:
            partitions = sorted(tmd.partitions)
        # A shared topic is read from its end: the answers to this process come later.
        out = []
        for p in partitions:
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.reply_topic, p), timeout=SETUP_TIMEOUT, cached=False)
            out.append(TopicPartition(self.reply_topic, p, high))
        return out

    def close(self):
        """Stop the threads, flush the producer, close the consumer and delete our own reply
        topic (errors ignored: a topic left behind is harmless). Idempotent."""
        self._stopping.set()
        for t in self._threads:
            t.join(5)
        self._threads = []
        self._fail(TallyError("the client is closed"))
        self._close_clients()
        if self._created_topic and self._controller:
            self._created_topic = False
            try:
                admin = AdminClient(self._client_config({}))
                fut = admin.delete_topics([self.reply_topic], request_timeout=5)[self.reply_topic]
                fut.result(10)
            except Exception as e:  # noqa: BLE001 - best effort
                log.debug("deleting reply topic %s: %s", self.reply_topic, e)

    def _close_clients(self):
        if self._producer is not None:
            self._producer.flush(5)
            self._producer = None
        if self._consumer is not None:
            try:
                self._consumer.close()
            except RuntimeError:
                pass
            self._consumer = None

    # --- the two background threads ----------------------------------------------------

    def _serve_deliveries(self):
        producer = self._producer
        while not self._stopping.is_set():
            producer.poll(0.1)

    def _read_replies(self):
        consumer = self._consumer
        while not self._stopping.is_set():
            try:
                msg = consumer.poll(0.1)  # returns at the first message (consume() does not)
            except KafkaException as e:
                self._consumer_error(e.args[0])
                continue
            if msg is None:
                continue
            if msg.error() is not None:
                self._consumer_error(msg.error())
            else:
                self._take(msg)

    def _consumer_error(self, err):
        if err.fatal():
            self._fail(TallyError(f"the reply consumer failed: {err}"))
            self._stopping.set()
        else:
            log.debug("reply consumer: %s", err)

    def _fail(self, error):
        """From now on every wait raises `error`; wake them all."""
        with self.cond:
            if self._failure is None:
                self._failure = error
            self.cond.notify_all()
            listeners = [b.listener for b in self._boxes.values() if b.listener is not None]
        for listener in listeners:
            listener()

    def _take(self, msg):
        event = _wire.decode(msg.value())
        corr = _wire.correlation_of(msg.headers(), event) if event is not None else None
        listener = None
        with self.cond:
            self._stats["messages_read"] += 1
            box = self._boxes.get(corr)
            if event is None:
                self._stats["unreadable"] += 1
            elif box is None:
                # An answer to a message whose wait is over, or another process's answer on
                # a shared reply topic.
                self._stats["late" if corr in self._issued else "foreign"] += 1
            elif event["id"] in box.ids:
                self._stats["duplicates"] += 1  # delivery is at least once
            else:
                box.ids.add(event["id"])
                box.answers.append(event)
                self._stats["answers"] += 1
                listener = box.listener
                self.cond.notify_all()
        if listener is not None:
            listener()

    # --- mailboxes, publishing ---------------------------------------------------------

    def open(self, correlation_id, listener=None):
        box = Mailbox(correlation_id, listener)
        with self.cond:
            self._issued.add(correlation_id)
            self._boxes[correlation_id] = box
        return box

    def discard(self, box):
        with self.cond:
            self._boxes.pop(box.correlation_id, None)

    def snapshot(self, box):
        """The mailbox's answers so far; raises when the client can no longer receive."""
        with self.cond:
            self.check()
            return list(box.answers)

    def check(self):
        """Raises the reason the client cannot receive answers (closed, consumer failed).
        The caller holds `cond`."""
        if self._failure is not None:
            raise self._failure

    def publish(self, event, correlation_id, on_done=None):
        """Produce `event` to <prefix>intents, key = its run id, with the reply headers.
        Returns the Delivery to wait on (or whose on_done is called from the producer's
        thread). Raises PublishError when librdkafka will not even queue it."""
        with self.cond:
            self.check()
        delivery = Delivery(on_done)
        headers = _wire.reply_headers(self.reply_topic, self.reply_partition, correlation_id)
        try:
            self._producer.produce(self.intents_topic, key=event["data"]["run_id"].encode("utf-8"),
                                   value=_wire.encode(event), headers=headers,
                                   on_delivery=delivery.report)
        except (BufferError, KafkaException) as e:
            raise PublishError(f"Kafka did not take {event['type']} {event['id']}: {e}") from None
        with self.cond:
            self._stats["published"] += 1
        return delivery

    def delivery_error(self, event, delivery):
        """The PublishError for a failed or missing delivery report, or None."""
        if not delivery.done.is_set():
            return PublishError(f"no delivery report for {event['type']} {event['id']} within "
                                f"{self.delivery_timeout:g} s")
        if delivery.error is not None:
            return PublishError(f"Kafka did not take {event['type']} {event['id']}: "
                                f"{delivery.error}")
        return None

    def stats(self):
        with self.cond:
            return dict(self._stats)
