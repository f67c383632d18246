"""The parts of one simulator instance, wired together: what every HTTP handler reaches."""

import logging
import time

from simulator.config import SimulatorConfig
from simulator.engine import Engine
from simulator.fault import FaultState
from simulator.journal import RequestLog
from simulator.stats import Stats

logger = logging.getLogger(__name__)


class App:
    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.journal = RequestLog(config.request_log)
        self.stats = Stats()
        self.fault = FaultState()
        self.engine = Engine(config, self.journal, self.stats, self.fault)
        self.started_at = time.time()
        self._ready_at = time.monotonic() + config.startup_s

    def starting(self) -> bool:
        """True during the simulated start-up (``startup_s``): /health answers 503."""
        return time.monotonic() < self._ready_at

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()
        self.journal.close()

    def stats_snapshot(self) -> dict:
        running, waiting = self.engine.load()
        return self.stats.snapshot(running, waiting)

    def reset_observations(self) -> None:
        self.journal.clear()
        running, waiting = self.engine.load()
        self.stats.reset(running, running + waiting)
