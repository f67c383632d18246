"""Every Redis key the pipeline uses, in one place.

All keys live under one prefix, apart from Celery's own. None of them expires
unless said: the ledger is the run's state and is rebuilt from the records on
disk if Redis loses it (``RUN`` tells whether it did).
Dataset names are validated by the reader (``[A-Za-z0-9][A-Za-z0-9_.-]*``),
so they are safe inside key names.
"""

PREFIX = "dg:"

# SET of dataset names this run knows.
DATASETS = PREFIX + "datasets"
# HASH dataset -> budget in tokens (live: `datagen budget` changes it).
BUDGETS = PREFIX + "budgets"
# STRING: the budget measure in force ("completion" or "total").
BUDGET_MEASURE = PREFIX + "budget_measure"
# HASHes server URL (password masked) -> request count / latency seconds sum /
# completion tokens sum, for the per-server latency metrics.
SERVER_REQUESTS = PREFIX + "server:requests"
SERVER_LATENCY_S = PREFIX + "server:latency_s"
SERVER_TOKENS = PREFIX + "server:completion_tokens"
# STRING JSON {id, created}: the ledger's identity, written once the ledger holds the
# run's state (first producer run, or a rebuild from the records). Absent = Redis lost its
# data: workers hold their commits and start nothing until the ledger is rebuilt.
RUN = PREFIX + "run"
# redis-py Lock: held by the one process rebuilding the ledger from the records.
REBUILD_LOCK = PREFIX + "rebuild_lock"


def worker_alive(worker_id: str) -> str:
    """STRING with a TTL of a lease, refreshed by the worker's heartbeat: who is up (for
    status and start-up checks). Reclaiming work goes by each entry's lease, not this."""
    return f"{PREFIX}alive:{worker_id}"


def worker_claims(worker_id: str) -> str:
    """HASH JSON [dataset, sample] -> 1, and "@at" -> the Redis time it was written, with a
    TTL of a lease: what the worker's tasks run now (from the start of the task, right after
    the early ack, to its end), written whole by each heartbeat (claims.lua). A sweep leaves
    claimed samples alone."""
    return f"{PREFIX}claims:{worker_id}"


CLAIMS_MATCH = PREFIX + "claims:*"
CLAIMS_AT = "@at"


# STRING owner id with a TTL of a second, dropped after the pass: the one process reaping
# stale leases now (liveness.REAP_LOCK_S).
REAPER_LOCK = PREFIX + "reaper_lock"
# STRING Redis time (s) at which the fleet's current stretch of contact with Redis began, kept
# alive by every successful heartbeat for half a lease (contact.lua): a reaper reaps only once
# it is a lease old, so after an outage every live worker has renewed its leases first.
CONTACT_SINCE = PREFIX + "contact_since"


# Celery's queues on Redis: kombu keeps one LIST per priority step (0 is served first), so a
# queue's length is the sum over these. Fresh work is sent at FRESH_PRIORITY, work that comes
# back (reaped, swept, woken, handed back) at RETRY_PRIORITY, ahead of it.
PRIORITY_STEPS = (0, 3, 6, 9)
RETRY_PRIORITY = 0
FRESH_PRIORITY = 9


def queue_lists(queue: str) -> list[str]:
    return [queue if step == 0 else f"{queue}\x06\x16{step}" for step in PRIORITY_STEPS]


def dataset_key(dataset: str, part: str) -> str:
    return f"{PREFIX}ds:{dataset}:{part}"


# Per-dataset parts, used as dataset_key(name, PART):
# HASH sample id -> "rid tokens" of the committed record (the first commit wins).
DONE = "done"
# HASH sample id -> "rid tokens": the done map a rebuild from the records writes batch by
# batch, renamed to DONE in the transaction that ends the rebuild (a leftover of a rebuild
# cut short is deleted by the next one).
DONE_REBUILD = "done_rebuild"
# HASH counters: tokens (budget measure), prompt_tokens, completion_tokens,
#   samples, truncated, dead, duplicates, discarded_tokens, revoked, refused.
STATS = "stats"
# HASH sample id -> JSON task payload of enqueued samples not yet done
# (lets a sweep re-enqueue what a crash lost); deleted when the dataset closes.
PENDING = "pending"
# HASH sample id -> JSON {rid, worker, server, start, max_new_tokens, prompt_tokens, b} of
# requests in flight (start in Redis time; b = the BUCKETS field the entry is counted in).
INFLIGHT = "inflight"
# HASH "<start bucket * 64 + cap class>" -> "<sum of their caps * 2^24 + requests in flight>"
# (a cap class is a double octave of max_new_tokens), "_prompt" -> their prompt tokens: what
# admission reads, so its cost grows with buckets, not requests nor caps (lua/_lib.lua).
BUCKETS = "buckets"
# ZSET sample id -> lease deadline (Redis time, s) of its in-flight entry, renewed by the
# owner's heartbeat; a stale one is reclaimed by any reaper, whoever owned it.
LEASES = "leases"
# ZSET sample id -> when it was parked: refused admission (no room in the budget yet),
# waiting for a commit or release to wake it. Its payload stays in PENDING.
PARKED = "parked"
# STRING with a TTL (the model refresh interval): set by the commit that refreshes MODEL.
MODEL_LOCK = "model_lock"
# STRING: why the dataset is closed ("budget", "max_samples", "operator"); absent = open.
CLOSED = "closed"
# HASH sample id -> JSON {reason, time} of samples that will not be retried.
DEAD = "dead"
# LIST of completed response lengths (newest first, capped): the length model.
LENGTHS = "lengths"
# LIST of "completion_tokens latency_s" of the 64 latest responses: current decode speed.
SPEEDS = "speeds"
# STRING int: bumped on every reopen; task messages are stamped "<dataset>#<epoch>" so a
# stamped revoke of a closed epoch never hits tasks enqueued after a reopen.
EPOCH = "epoch"
# STRING MessagePack: the length model admission uses (see admission.encode_model).
MODEL = "model_msgpack"
# STRING JSON: the same model as versions before MessagePack read it, kept beside it while
# processes of such a version may still run against this Redis (adding a newer machine to a
# running fleet). Same lifetime as MODEL.
MODEL_JSON = "model"
# ZSET time -> "tokens@time" after each commit, last 120 s only: recent tokens/s.
PROGRESS = "progress"
# ZSET time -> event log of budget decisions (close/reopen), for status.
EVENTS = "events"

LENGTHS_KEPT = 4096

# Extraction phase (datagen/extraction/ledger.py): one prefix; nothing expires but the leases.
EXTRACT_PREFIX = PREFIX + "extract:"
# HASH shard path (relative to output_dir) -> JSON result of its last complete run:
#   {sha256, samples, written, skipped_done, skipped_overlong, truncated, failed, tokens,
#    bytes, seconds, worker, time}.
EXTRACT_DONE = EXTRACT_PREFIX + "done"
# HASH shard path -> JSON {sha256, reason, time, worker}: shards that failed every retry
#   (sha256 "" when the shard could not be read: dead whatever its content).
EXTRACT_DEAD = EXTRACT_PREFIX + "dead"
# HASH shard path -> samples of that shard dead-lettered in its last run (set, not added, so a
# redelivered shard is not counted twice). The reasons are in <extraction_dir>/dead_letters.jsonl.
EXTRACT_DEAD_SAMPLES = EXTRACT_PREFIX + "dead_samples"
# HASH shard path -> JSON {handled, total, worker, time}: samples handled in the current run.
EXTRACT_PROGRESS = EXTRACT_PREFIX + "progress"
# STRING worker id with a TTL (settings.lease_s), refreshed while the worker runs the shard.
EXTRACT_LEASE = EXTRACT_PREFIX + "lease:"
# HASH shard path -> JSON {tries, owner, since, not_before, sent, sent_at, requeued_at,
#   requeued_by}: shards sent or taken, not yet done or dead. Written before each message is
#   sent (``sent`` until a run takes it: the gpu queue has no acks, so this is the only trace
#   of a message a worker took). An entry with an owner but no lease is a run that died
#   (worker or rank killed); one ``sent`` over a lease ago, neither queued nor leased, lost its
#   message with the worker that took it: the reaper re-enqueues both ahead of fresh shards,
#   and dead-letters a shard after extract_max_retries dead runs. Deleted by done/dead.
EXTRACT_RUNNING = EXTRACT_PREFIX + "running"
# STRING owner id with a TTL of one second: the one gpu worker reaping stale shards now.
EXTRACT_REAPER_LOCK = EXTRACT_PREFIX + "reaper_lock"

# States streamed into SpecForge (datagen/stream/ledger.py), one set of keys per epoch; nothing
# expires: they are the epoch's exactly-once record (`datagen status` reads them).
STREAM_PREFIX = PREFIX + "stream:"
# SET of the epochs that have streamed anything.
STREAM_EPOCHS = STREAM_PREFIX + "epochs"
# STRING: the epoch the last `datagen extract` asked for; a gpu worker of another refuses.
STREAM_ASKED_EPOCH = STREAM_PREFIX + "asked_epoch"


def stream_reserved(epoch: int) -> str:
    """HASH sample id -> bytes: room taken under stream_resident_bytes before its put (a put
    that a crash cut short keeps its room until the re-run puts the same id again)."""
    return f"{STREAM_PREFIX}{epoch}:reserved"


def stream_published(epoch: int) -> str:
    """HASH sample id -> bytes: put into the store and its ref published (the resume skips it)."""
    return f"{STREAM_PREFIX}{epoch}:published"


def stream_acked(epoch: int) -> str:
    """HASH sample id -> the Redis time first seen acknowledged in the consumer's SQLite."""
    return f"{STREAM_PREFIX}{epoch}:acked"


def stream_totals(epoch: int) -> str:
    """HASH reserved_bytes, acked_bytes: resident bytes = reserved_bytes - acked_bytes."""
    return f"{STREAM_PREFIX}{epoch}:totals"
