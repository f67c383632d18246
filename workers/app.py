"""Entry point for `celery -A workers.app worker`: the shared app plus the task modules.

The app comes from datagen.celery_app with settings from the environment
(``DATAGEN_CONFIG`` and ``DATAGEN_*``), exactly as the producer and Flower build it.
"""

import workers.extract  # noqa: E402,F401  (registers datagen.extract; torch loads lazily)
import workers.generate  # noqa: E402,F401  (registers datagen.generate)
import workers.task_log  # noqa: E402,F401  (Celery's per-task lines at DEBUG: task_log.py)
from datagen.celery_app import app

__all__ = ["app"]
