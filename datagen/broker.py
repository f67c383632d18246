"""The Redis transport every process of a run uses: kombu's, with four costs taken out.

A py-spy profile of the short worker (150 threads, a simulator at 2 ms per decode step)
put ~70% of the time it held the GIL in Celery's consumer thread, and most of that here:

- building a new ``redis.Redis`` (and its table of response callbacks) for every publish,
  event flush, unacked-index write and ack, ~19% of the samples: kombu's
  ``Channel.conn_or_acquire`` makes a client per call. Here a channel keeps one client on
  its connection pool (redis-py clients are safe to share between threads: each command
  takes a connection from the pool, each pipeline is its own object).
- the unacked bookkeeping of each delivery, ~30%: a pipeline writes the message into
  kombu's ``unacked`` hash and index, another removes it at the ack. The generation
  queues' tasks are acked as they start anyway (early ack, DESIGN.md), and work lost with
  a worker comes back through the ledger's leases and the sweep, not through kombu's
  restore (which waits out the 12 h visibility timeout). So their consumer takes messages
  with ``no_ack`` (``NoAckAMQP``): a message leaves Redis with its BRPOP rather than at
  the early ack microseconds later. A worker killed in between loses the message as it
  did before; its sample stays pending in the ledger and the sweep sends it again.
- publishing task events, ~29% once the two above were gone: Celery buffers a worker's
  task events and flushes them at the next turn of its event loop, so at a few hundred
  tasks a second nearly every event went out as a message of its own.
  ``EventDispatcher`` publishes at most every ``EVENT_FLUSH_S`` (or at Celery's limit of
  24 buffered): Flower sees an event up to 0.1 s later, batched with its neighbours.
- one message per BRPOP: kombu's poller delivers one message per turn of the event loop, so
  a worker of 150 threads needed 150 BRPOPs and turns to fill them, and one per task ended
  after. Here, after a BRPOP's message, the channel takes as many more as the worker could
  start now (``TakeFreeSlots``: Celery's own bound, its reserved requests against its
  concurrency) in one script on the same connection, the first queue and priority first as
  BRPOP orders them; never more, so no message waits in a worker that has no thread for it.
  A gpu worker (one shard at a time) has no free slot once it holds one: it takes one.
  Side by side (bench_generate.py --short-workers 2 --base-tree, 2 ms, 9 rounds): 6.4-10.6%
  less CPU per sample for the worker with it, median 9.0% (BENCHMARKS.md).

Measured (BENCHMARKS.md, "The queue's own cost on a fast server"): the workers' CPU per
1,000 samples 3.25-4.11 s before, 2.44-2.76 s after, in four runs each; Redis round trips
per generated sample for every client together 8.2 before, 3.7 after.

The gpu queue is consumed with ``no_ack`` too, for another reason: no message of it may wait
in `unacked`, because the extraction ledger governs re-runs (datagen/extraction/ledger.py) and
kombu would deliver such a message again once the 12 h visibility timeout is out, long after
its shard was re-run: a late duplicate. With acks, one did wait there: rank 0 of a replica runs
the solo pool, and Celery's early ack goes through ``hub.call_soon``, which runs only once the
task returns, so the shard's message sat in `unacked` for the whole run, and for 12 h after a
kill. One shard at a time still holds without kombu's count of delivered messages:
``worker_disable_prefetch`` makes the poller ask Celery's reserved requests, not kombu, whether
another BRPOP may go out (celery/worker/consumer/tasks.py), and a prefork worker's request is
reserved until its child has run it. A message taken but not started (the worker died in
between) is covered by the ledger: each shard's entry is written before its message is sent,
and the reaper sends a shard again that has stayed neither queued nor leased for a lease.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from time import monotonic
from typing import Any

import redis
from celery import bootsteps
from celery.app.amqp import AMQP
from celery.app.events import Events as CeleryEvents
from celery.events import dispatcher
from kombu import transport as kombu_transport
from kombu.asynchronous import get_event_loop
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

# Queues whose tasks are consumed without kombu's unacked bookkeeping: every queue of a run.
NO_ACK_QUEUES = frozenset({"short", "long", "gpu"})
TRANSPORT = "datagen.broker:Transport"
SCHEMES = ("redis", "rediss")
EVENT_FLUSH_S = 0.1
log = logging.getLogger(__name__)


# Pops up to ARGV[1] messages, the first keys first (kombu's BRPOP order: priority, then
# queue), each returned after the key it came from.
TAKE_SCRIPT = """
local out, n = {}, tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  while #out < 2 * n do
    local item = redis.call('RPOP', key)
    if not item then break end
    out[#out + 1] = key
    out[#out + 1] = item
  end
end
return out
"""


class Channel(kombu_redis.Channel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # kombu's own mark for consumers whose messages need no ack (Message.ack skips
        # them); the virtual transports leave it None.
        self.no_ack_consumers: set[str] = set()
        # How many more messages the worker runs at once (TakeFreeSlots sets it on a
        # worker's task channel); None: one message per BRPOP, as kombu takes them.
        self.free_slots: Any = None

    def _brpop_read(self, **options: Any) -> bool:
        got = super()._brpop_read(**options)  # raises Empty when the BRPOP timed out
        free = self.free_slots() if self.free_slots is not None else 0
        if free > 0 and not self.global_keyprefix:
            self._take(free)
        return got

    def _take(self, n: int) -> None:
        """Deliver up to ``n`` more messages of the queues consumed, in one round trip on
        the BRPOP's connection (idle once its reply is read)."""
        keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps
                for queue in self.active_queues]
        if not keys:
            return
        try:
            reply = self.client.eval(TAKE_SCRIPT, len(keys), *keys, n)
        except self.connection_errors:
            self.client.connection.disconnect()  # reconnected at the next BRPOP, as kombu's
            raise
        except redis.ResponseError as exc:  # scripts refused (an ACL): one per BRPOP on
            log.warning("taking more than one message per BRPOP is off: %s", exc)
            self.free_slots = None
            return
        for i in range(0, len(reply), 2):
            dest = bytes_to_str(reply[i]).rsplit(self.sep, 1)[0]
            self.connection._deliver(loads(bytes_to_str(reply[i + 1])), dest)

    @cached_property
    def _shared_client(self) -> redis.Redis:
        return self._create_client()

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        yield client or self._shared_client

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str,
                      **kwargs: Any) -> Any:
        if no_ack:
            self.no_ack_consumers.add(consumer_tag)

            def tagged(message: Any) -> Any:
                message.delivery_info["consumer_tag"] = consumer_tag
                return callback(message)
            return super().basic_consume(queue, no_ack, tagged, consumer_tag, **kwargs)
        return super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)

    def basic_cancel(self, consumer_tag: str) -> Any:
        self.no_ack_consumers.discard(consumer_tag)
        return super().basic_cancel(consumer_tag)


class TakeFreeSlots(bootsteps.StartStopStep):
    """Tells a worker's task channel how many tasks it could start now (Celery's own bound
    for ``worker_disable_prefetch``: its reserved requests against its concurrency), so one
    BRPOP's turn of the event loop takes that many messages. Started again with the task
    consumer when the connection is."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        from celery.worker import state

        if not c.app.conf.worker_disable_prefetch or c.task_consumer is None:
            return

        def free() -> int:
            limit = getattr(c.controller, "max_concurrency", None) or c.pool.num_processes
            return limit - len(state.reserved_requests)
        c.task_consumer.channel.free_slots = free


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Resolve kombu's ``redis://`` and ``rediss://`` to this transport in this process.

    Through the scheme rather than Celery's ``broker_transport`` setting, so URLs keep
    their scheme everywhere kombu prints or parses one (Flower picks its broker client by
    the scheme of ``as_uri()``; ``rediss`` keeps its TLS handling).
    """
    for scheme in SCHEMES:
        kombu_transport.TRANSPORT_ALIASES[scheme] = TRANSPORT
        kombu_transport._transport_cache.pop(scheme, None)


class NoAckAMQP(AMQP):
    """Celery's AMQP helpers, consuming the run's queues with ``no_ack``."""

    def TaskConsumer(self, channel: Any, queues: Any = None, accept: Any = None,  # noqa: N802
                     **kw: Any) -> Any:
        chosen = queues or list(self.queues.consume_from.values())
        if chosen and {queue.name for queue in chosen} <= NO_ACK_QUEUES:
            kw.setdefault("no_ack", True)
        return super().TaskConsumer(channel, queues=chosen, accept=accept, **kw)


class EventDispatcher(dispatcher.EventDispatcher):
    """Celery's, publishing buffered task events at most every EVENT_FLUSH_S.

    Celery's own callback for a buffered event is ``hub.call_soon(flush)``, which also
    wakes the worker's event loop when a task thread sends one. That wake is what lets a
    worker with ``worker_disable_prefetch`` take its next message as soon as a task ends
    (nothing else wakes the loop then; without it the next BRPOP waits for a timer), so
    it is kept: every event still wakes the loop, but the loop publishes only when the
    last publish is EVENT_FLUSH_S old, and a timer sends what is left.
    """

    def __init__(self, *args: Any, on_send_buffered: Any = None, **kwargs: Any) -> None:
        self._last_flush = 0.0
        self._flush_due = False
        # Celery passes a callback only where it buffers (a worker with an event loop).
        soon = self._wake if on_send_buffered is not None else None
        super().__init__(*args, on_send_buffered=soon, **kwargs)

    def _wake(self) -> None:
        hub = get_event_loop()
        if hub is None:
            self.flush()
        else:
            hub.call_soon(self._flush_if_due)

    def _flush_if_due(self) -> None:
        """In the event loop's thread."""
        wait = self._last_flush + EVENT_FLUSH_S - monotonic()
        if wait <= 0:
            self._flush_now()
        elif not self._flush_due:
            self._flush_due = True
            get_event_loop().call_later(wait, self._flush_now)

    def _flush_now(self) -> None:
        self._flush_due = False
        self._last_flush = monotonic()
        self.flush()

    def close(self) -> None:
        # What the timer has not sent yet goes now (Celery's close publishes nothing).
        self.flush(errors=False)
        super().close()


class Events(CeleryEvents):
    dispatcher_cls = "datagen.broker:EventDispatcher"
