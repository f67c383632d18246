"""The generation core: everything that makes phase 1 exact across many hosts.

    job.py        what a task message carries, and the prompt store it points into
    ledger.py     per-dataset state in Redis; every atomic step is a script in lua/
    admission.py  the length model the budget guard admits requests by
    lease.py      one in-flight request's hold on the ledger, released in one place
    liveness.py   heartbeats, lease renewal and the reaper that gives lost work back
    runner.py     the steps of one job: check → call → persist → commit
    guard.py      what follows a close: revokes, aborts, the close event
    follower.py   run control: follow a run to its end, keeping it from stalling
    records.py    durable response records, one file per process start
    index.py      a small entry per record, so merge and recovery stream
    recovery.py   rebuilding the ledger from the records on disk
    merge.py      one raw_responses.jsonl per dataset from the record files
"""
