"""Overlap of forward, device->host copy and file writes.

    GPU (default stream)   forward batch k+1 ...............
    GPU (copy stream)        D2H batch k -> pinned slot (non_blocking, event)
    writer threads           wait event, copy sample out of the slot, release slot,
                             torch.save + fsync + rename + manifest

Pinned slots are reused because a fresh ``.to("cpu")`` per batch runs at ~1.3 GB/s (new host
pages every time) against ~55 GB/s into a reused pinned buffer (measured on an H200 host). A slot
goes back to the pool once every sample of its batch has been copied out, so at most
``n_slots`` batches wait for the disk; pending sample writes are bounded by a semaphore, so a
slow disk slows the forward loop instead of filling host memory. On CPU the same structure
runs without pinning: the batch buffer itself is the host view.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A batch's states on the host; valid after ``wait``; ``release`` returns the slot."""

    host: torch.Tensor
    event: Any
    release: Callable[[], None]

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostStaging:
    def __init__(self, device: torch.device, width: int, dtype: torch.dtype,
                 capacity_tokens: int, n_slots: int = 2):
        self.device, self.width, self.dtype = device, width, dtype
        self.capacity = capacity_tokens
        self.cuda = device.type == "cuda"
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._to_allocate = n_slots if self.cuda else 0
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def _slot(self, tokens: int) -> tuple[torch.Tensor, bool]:
        """(pinned buffer, pooled?) - a batch larger than the slots gets a one-off buffer."""
        if tokens > self.capacity:
            return torch.empty(tokens, self.width, dtype=self.dtype, pin_memory=True), False
        if self._free.empty() and self._to_allocate > 0:
            self._to_allocate -= 1  # lazy: a shard of short samples never needs all slots
            return torch.empty(self.capacity, self.width, dtype=self.dtype, pin_memory=True), True
        return self._free.get(), True  # blocks until a writer releases one: back-pressure

    def stage(self, dev_buf: torch.Tensor) -> Staged:
        if not self.cuda:
            return Staged(dev_buf, None, lambda: None)
        tokens = dev_buf.shape[0]
        slot, pooled = self._slot(tokens)
        host = slot[:tokens]
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # forward has finished
        with torch.cuda.stream(stream):
            host.copy_(dev_buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # the allocator must not hand dev_buf's memory to the next forward before the copy ends
        dev_buf.record_stream(stream)
        release = (lambda: self._free.put(slot)) if pooled else (lambda: None)
        return Staged(host, event, release)


class Countdown:
    """Calls ``on_zero`` once ``n`` parties have called ``done`` (from any thread)."""

    def __init__(self, n: int, on_zero: Callable[[], None]):
        self._n, self._on_zero, self._lock = n, on_zero, threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._on_zero()


class AsyncWriter:
    """Thread pool whose ``submit`` blocks while ``max_pending`` tasks are unfinished."""

    def __init__(self, threads: int, max_pending: int):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="extract-write")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._futures: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        self._slots.acquire()
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        self._futures.append(fut)
        return fut

    def drain(self) -> list[Future]:
        """Wait for every submitted task; returns them (done) and forgets them."""
        futures, self._futures = self._futures, []
        for fut in futures:
            fut.exception()  # waits; errors are read by the caller from the future
        return futures

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
