"""`datagen flower`: Flower 2.2 as Celery's `flower` command, with two changes.

- The Broker page and ``/api/queues/length`` list every queue of the run (short, long,
  gpu). Flower lists only the queues of the workers it has inspected, and it inspects a
  worker once, when it first sees it, so a queue whose worker came later (or is busy
  loading a model) never appeared.
- ``/metrics`` requires the same login as every page unless ``flower_open_metrics`` is
  set. Flower serves it without one; it names workers, queues and task counts.
  ``/healthcheck`` stays open: it answers "OK" and nothing else, for health probes.

    python -m datagen.operations.flower --port=5555 --address=127.0.0.1 --basic-auth=user:pass
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tornado import web

from config.settings import load_settings
from datagen.celery_app import QUEUES


def patch_flower(open_metrics: bool) -> None:
    from flower.views import BaseHandler  # noqa: PLC0415 (only in the Flower process)
    from flower.views.monitor import Metrics  # noqa: PLC0415

    active = BaseHandler.get_active_queue_names

    def every_queue(self: BaseHandler) -> list[str]:
        return sorted(set(active(self)) | set(QUEUES))

    BaseHandler.get_active_queue_names = every_queue
    if not open_metrics:
        Metrics.get = web.authenticated(Metrics.get)


def main(argv: Sequence[str] | None = None) -> int:
    from celery.bin.celery import main as celery_main  # noqa: PLC0415

    patch_flower(load_settings().flower_open_metrics)
    args = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["celery", "-A", "datagen.celery_app", "flower", *args]
    return celery_main()


if __name__ == "__main__":
    sys.exit(main())
