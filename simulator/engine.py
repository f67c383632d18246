"""The scheduler: a FIFO waiting queue, a bounded running batch and one thread that decodes.

Timing model (all durations times `time_scale`):
- a request admitted into the batch first prefills for `prompt_tokens / prefill_tokens_per_s`;
  the prefill yields its first output token, as on a real server;
- then every decode step yields one token for every running request; a step lasts
  `decode_step_s * (1 + batch_slowdown * running / max_running_requests) * slow_factor`.

The engine thread works in ticks of at least MIN_TICK_S: when steps are shorter than that it
decodes several steps per wake-up (and more when it woke late), crediting each request with
the tokens it would have made in that time, so hundreds of running requests cost one loop
pass per tick, not one sleep per token per request. HTTP threads wait on per-request Events,
never on a shared condition, so a tick wakes only the requests that have something new to send.
"""

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from simulator.config import SimulatorConfig
from simulator.errors import DuplicateRid, QueueFull
from simulator.fault import FaultState
from simulator.journal import RequestLog
from simulator.lengths import OutputPlan, output_sha
from simulator.stats import Stats

logger = logging.getLogger(__name__)

MIN_TICK_S = 0.005
MAX_CATCH_UP_S = 1.0
# SGLang 0.5.23's finish_reason for a request aborted through /abort_request.
ABORT_REASON = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
# ... and for one still in its waiting queue: the scheduler hands it back to the tokenizer
# manager unrun, which answers this shorter reason (tokenizer_manager._handle_abort_req).
WAITING_ABORT_REASON = {"type": "abort", "message": "Abort in waiting queue"}
SHUTDOWN_REASON = {"type": "abort", "message": "Server is shutting down", "status_code": None,
                   "err_type": None}


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt_tokens: int
    plan: OutputPlan
    stream: bool = False
    stream_interval: int = 1
    dataset: str | None = None
    created_at: float = field(default_factory=time.time)
    decoded: int = 0
    ready_at: float = 0.0  # monotonic time at which its prefill ends
    finish_reason: dict | None = None
    finished_at: float = 0.0
    progress: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Tick:
    start: float
    end: float
    steps: int
    step_s: float


def _stretch(tick: _Tick, now: float) -> _Tick:
    """Cover the time that really passed when the engine thread woke up late.

    A thread starved by the GIL (hundreds of HTTP threads) wakes late; crediting the steps that
    fit in the elapsed time keeps the simulated tokens/s what the config says.
    """
    if now - tick.end <= MIN_TICK_S:
        return tick
    span = min(now - tick.start, MAX_CATCH_UP_S)
    steps = max(tick.steps, int(span / tick.step_s))
    return _Tick(tick.start, tick.start + steps * tick.step_s, steps, tick.step_s)


def stream_points(old: int, new: int, interval: int) -> range:
    """Output lengths in (old, new] at which SGLang sends a stream chunk.

    SGLang sends when `len % interval == 0` for interval 1 and `len % interval == 1` above it,
    so the first token always goes out at once.
    """
    residue = 0 if interval == 1 else 1
    first = old + 1 + (residue - (old + 1)) % interval
    return range(first, new + 1, interval)


class Engine:
    def __init__(
        self, config: SimulatorConfig, journal: RequestLog, stats: Stats, fault: FaultState
    ) -> None:
        self._config = config
        self._journal = journal
        self._stats = stats
        self._fault = fault
        self._cond = threading.Condition()
        self._waiting: deque[SimRequest] = deque()
        self._running: dict[str, SimRequest] = {}
        self._in_flight: dict[str, SimRequest] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="sim-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for req in list(self._in_flight.values()):
                self._finish(req, SHUTDOWN_REASON)
            self._waiting.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def submit(self, reqs: list[SimRequest]) -> None:
        """Queue requests, all or none; raises DuplicateRid or QueueFull."""
        with self._cond:
            seen: set[str] = set()
            for req in reqs:
                if req.rid in self._in_flight or req.rid in seen:
                    raise DuplicateRid(req.rid)
                seen.add(req.rid)
            self._check_queue_room(len(reqs))
            for req in reqs:
                self._in_flight[req.rid] = req
                self._waiting.append(req)
                self._stats.add("requests_started")
                self._stats.add("prompt_tokens", req.prompt_tokens)
                self._journal.record("start", req.rid, req.dataset, prompt_tokens=req.prompt_tokens)
            self._stats.saw_in_flight(len(self._in_flight))
            self._admit(time.monotonic())
            self._cond.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False, exact: bool = True) -> int:
        """Abort the in-flight request whose rid is `rid`, as SGLang 0.5.23 does by default.

        Its tokenizer manager looks the rid up exactly and drops one it does not run
        (answering 200 all the same); only with --tokenizer-worker-num 2 does an unknown rid
        reach the scheduler, which aborts every request whose rid starts with it: that is
        `exact=False` (``--abort-by-prefix``). An empty rid aborts nothing, as in SGLang.
        """
        with self._cond:
            victims = [
                req for req in self._in_flight.values()
                if abort_all or (rid and (req.rid == rid if exact else req.rid.startswith(rid)))
            ]
            for req in victims:
                self._finish(req, ABORT_REASON if req.rid in self._running
                             else WAITING_ABORT_REASON)
            if victims:
                self._waiting = deque(r for r in self._waiting if r.finish_reason is None)
                self._admit(time.monotonic())
                self._cond.notify_all()
            return len(victims)

    def progress_of(self, req: SimRequest) -> tuple[int, dict | None]:
        """(tokens decoded, finish_reason or None), consistent without taking the engine lock.

        Hundreds of stream threads call this per chunk; taking the engine's lock here starved
        the engine thread of it (one tick per half second). The engine writes `decoded` before
        `finish_reason` and never changes `decoded` after, so reading in the opposite order
        never pairs a finish_reason with a stale count.
        """
        reason = req.finish_reason
        return req.decoded, reason

    def load(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def _check_queue_room(self, incoming: int) -> None:
        limit = self._config.max_queued_requests
        if limit is None:
            return
        # A request that a free batch slot takes at once never queues; only the rest count.
        occupied = len(self._running) + len(self._waiting)
        if occupied + incoming > self._config.max_running_requests + limit:
            raise QueueFull()

    def _loop(self) -> None:
        with self._cond:
            tick: _Tick | None = None
            while not self._stopped:
                now = time.monotonic()
                if not self._running:
                    tick = None
                    self._cond.wait(0.5)
                    continue
                if tick is None:
                    tick = self._plan_tick(now)
                if now < tick.end:
                    self._cond.wait(tick.end - now)
                    continue
                tick = _stretch(tick, now)
                self._decode(tick)
                self._admit(tick.end)
                # Small lateness is absorbed by scheduling from the planned end; after a long
                # stall (beyond MAX_CATCH_UP_S) the lost time is dropped instead of replayed.
                on_time = now - tick.end < max(MIN_TICK_S, tick.step_s)
                start = tick.end if on_time else now
                tick = self._plan_tick(start) if self._running else None

    def _plan_tick(self, start: float) -> _Tick:
        cfg = self._config
        load = len(self._running) / cfg.max_running_requests
        step_s = (cfg.decode_step_s * (1 + cfg.batch_slowdown * load)
                  * cfg.time_scale * self._fault.slow_factor())
        steps = max(1, math.ceil(MIN_TICK_S / step_s))
        return _Tick(start, start + steps * step_s, steps, step_s)

    def _admit(self, now: float) -> None:
        cfg = self._config
        admitted = False
        while self._waiting and len(self._running) < cfg.max_running_requests:
            req = self._waiting.popleft()
            prefill_s = req.prompt_tokens / cfg.prefill_tokens_per_s
            req.ready_at = now + prefill_s * cfg.time_scale * self._fault.slow_factor()
            self._running[req.rid] = req
            admitted = True
        if admitted:
            self._stats.saw_running(len(self._running))

    def _decode(self, tick: _Tick) -> None:
        made = 0
        steps = 0  # of the tick's steps, those some request still needed
        for req in list(self._running.values()):
            if req.ready_at > tick.end:
                continue  # still prefilling
            if req.ready_at <= tick.start:
                tokens = tick.steps
            else:
                # Prefill ended inside this tick: its first token, then whole steps after it.
                tokens = 1 + int((tick.end - req.ready_at) / tick.step_s)
            advanced = self._advance(req, min(tokens, tick.steps))
            made += advanced
            steps = max(steps, advanced)
        if made:
            self._stats.add("tokens_generated", made)
            self._stats.add("decode_steps", steps)
            self._stats.add("decode_s", steps * tick.step_s)

    def _advance(self, req: SimRequest, tokens: int) -> int:
        old = req.decoded
        req.decoded = min(len(req.plan.ids), old + tokens)
        if req.decoded >= len(req.plan.ids):
            self._finish(req, req.plan.finish_reason)
        elif req.stream and stream_points(old, req.decoded, req.stream_interval):
            req.progress.set()
        return req.decoded - old

    def _finish(self, req: SimRequest, reason: dict) -> None:
        req.finish_reason = reason
        req.finished_at = time.time()
        self._running.pop(req.rid, None)
        self._in_flight.pop(req.rid, None)
        aborted = reason["type"] == "abort"
        self._stats.add("requests_aborted" if aborted else "requests_finished")
        self._journal.record(
            "abort" if aborted else "finish",
            req.rid,
            req.dataset,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.decoded,
            output_sha=output_sha(req.plan.ids[: req.decoded]),
            status=200,
            finish_reason=reason["type"],
        )
        req.progress.set()
        req.done.set()
