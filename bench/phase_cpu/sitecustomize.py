"""CPU per step of a generation task, inside a real worker (bench only).

With this folder on PYTHONPATH and DATAGEN_BENCH_PHASES naming a folder, every `celery
worker` process started from then on (``bench_generate.py`` passes its environment to
the workers it starts) adds up the thread CPU (``time.thread_time``: user + system of the
calling thread) of each step of ``datagen.generation.runner`` (admit, call, persist,
commit, read_prompt, run_job), of the ledger calls and of the records' append, and
writes ``phases-<pid>.json`` at exit: step -> [calls, CPU seconds]. A step's time
includes the steps it calls. No profiler runs: each step costs one more function call.

    DATAGEN_BENCH_PHASES=/tmp/phases PYTHONPATH=$PWD/bench/phase_cpu \\
        .venv/bin/python bench/bench_generate.py --phases throughput --decode-steps-s 0.002 \\
        --rounds 1
    .venv/bin/python bench/phase_cpu/report.py /tmp/phases
"""

from __future__ import annotations

import os
import sys

_OUT = os.environ.get("DATAGEN_BENCH_PHASES")
STEPS = {
    "datagen.generation.runner": ("run_job", "admit", "call", "persist", "commit",
                                  "read_prompt", "trained_tokens"),
}
METHODS = {
    ("datagen.generation.ledger", "Ledger"): ("admit", "commit", "refresh_model",
                                              "publish_claims", "renew", "contact"),
    ("datagen.generation.records", "RecordWriter"): ("append",),
    ("datagen.client", "SGLangClient"): ("generate",),
}


def _install(out: str) -> None:
    import atexit
    import collections
    import importlib
    import json
    import threading
    import time

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    lock = threading.Lock()
    patched = threading.Event()

    def timed(name, fn):
        def step(*args, **kwargs):
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - started
                with lock:
                    totals[name][0] += 1
                    totals[name][1] += spent
        step.timed = True
        return step

    def patch() -> None:
        for module, names in STEPS.items():
            mod = importlib.import_module(module)
            for name in names:
                setattr(mod, name, timed(f"runner.{name}", getattr(mod, name)))
        for (module, cls_name), names in METHODS.items():
            cls = getattr(importlib.import_module(module), cls_name)
            for name in names:
                setattr(cls, name, timed(f"{cls_name}.{name}", getattr(cls, name)))

    def patch_task() -> None:
        task = sys.modules.get("workers.generate")  # it imported run_job by name
        if task is not None and not getattr(task.run_job, "timed", False):
            task.run_job = sys.modules["datagen.generation.runner"].run_job

    run = threading.Thread.run

    def run_patched(self):
        with lock:
            first = not patched.is_set()
            patched.set()
        if first:
            patch()
        patch_task()
        run(self)

    threading.Thread.run = run_patched

    def dump() -> None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"phases-{os.getpid()}.json"), "w") as fh:
            json.dump(dict(totals), fh, indent=1)

    atexit.register(dump)


if _OUT and "worker" in sys.argv and "-Q" in sys.argv:
    _install(_OUT)
