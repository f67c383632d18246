"""Finished requests' states out of the engine's cache and into files, in bounded memory.

The cache is vLLM's hidden-states group, ``[blocks, ids, block_size, H]``: a request's states
are the rows of its blocks in order, cut at its ``n`` positions. This module works on plain
torch tensors (no vLLM: datagen/extraction/vllm_connector.py feeds it from inside the engine),
so it runs and is tested without an engine.

- A request's blocks are copied ``chunk_blocks`` at a time into one of ``host_buffers`` host
  buffers of that size (pinned on CUDA: one index_select into a chunk-sized staging buffer
  and one copy to the host, on a side stream); a writer thread turns the chunk into the
  file's tensors and writes them in place (safetensors: at offsets the header fixed when the
  file was opened; torch.save: into the sample's tensors, saved whole after the last chunk;
  the files: datagen/extraction/state_sink.py).
- Backpressure: a chunk is copied only when a buffer is free, and a request counts as
  *released* (its blocks may be freed) only once all its chunks are on the host. When the
  writers fall behind, the requests that ended keep their blocks in the cache, where vLLM
  already accounted for them, instead of growing the GPU's or the host's memory.

So the copy path holds, whatever the number and length of the requests ending together: on
the GPU one staging chunk; on the host ``host_buffers`` chunks, what the writer threads derive
from the chunks they hold, and (torch.save only) the samples being assembled, admitted up to
``assembly_bytes`` (one at least).

A write that fails (a full disk: ENOSPC) fails that file alone: its temporary is removed,
its buffers return to the pool, the blocks are released as usual, and ``on_done`` gets the
error (an OSError keeping its errno) with a message naming the folder and its free space
(state_sink.py: ``write_failure``; ``release_lock`` leaves it in the lock for the reader).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from datagen.extraction.state_sink import Sink, write_failure

log = logging.getLogger("datagen.state_copy")



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / DeepseekV3RMSNorm, in the same order of operations."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(weight.dtype)


@dataclass(frozen=True)
class StateLayout:
    """Which cached ids go where: ``slots`` lists the aux ids in the file's order, then the
    last layer's; the final state is the model's RMSNorm over the last one (post-norm, as
    SpecForge stores it)."""

    slots: tuple[int, ...]
    norm: torch.Tensor
    eps: float
    dtype: torch.dtype

    def tensors(self, chunk: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """chunk [blocks, ids, block_size, H] (cache layout) -> its first m positions as
        (aux [m, len(aux) * H] in the file's order, final [m, H]); row by row, so equal to
        the same rows taken from the whole request at once."""
        hidden = chunk.shape[-1]

        def rows(slot: int) -> torch.Tensor:
            return chunk[:, slot].reshape(-1, hidden)[:m]

        aux = torch.cat([rows(s) for s in self.slots[:-1]], dim=1).to(self.dtype)
        return aux.contiguous(), rms_norm(rows(self.slots[-1]), self.norm,
                                          self.eps).contiguous()

    def widths(self, hidden: int) -> tuple[int, int]:
        return (len(self.slots) - 1) * hidden, hidden


class HostPool:
    """``count`` host buffers of one chunk each (pinned where the cache is on CUDA), made
    once; ``take`` gives None when all are out."""

    def __init__(self, count: int, shape: Sequence[int], dtype: torch.dtype, pin: bool):
        self._free = [torch.empty(tuple(shape), dtype=dtype, pin_memory=pin)
                      for _ in range(max(1, count))]
        self.count = len(self._free)
        self.buffer_bytes = self._free[0].numel() * self._free[0].element_size()
        self.peak_out = 0
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor | None:
        with self._lock:
            if not self._free:
                return None
            buf = self._free.pop()
            self.peak_out = max(self.peak_out, self.count - len(self._free))
            return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    @property
    def out(self) -> int:
        with self._lock:
            return self.count - len(self._free)


@dataclass(eq=False)
class Job:
    req_id: str
    blocks: list[int]
    n: int
    sink: Sink
    on_done: Callable[[Job, OSError | None], None]
    copied: int = 0          # blocks copied to the host so far
    chunks: int = 0          # chunks handed to the writers
    written: int = 0         # chunks the writers are done with
    opened: bool = False
    issued_all: bool = False  # no more chunks will be handed to the writers
    settled: bool = False
    error: OSError | None = None
    last_event: Any = None   # the copy of its last chunk (CUDA), None when on the host
    lock: threading.Lock = field(default_factory=threading.Lock)


class StateCopier:
    """Copies finished requests from ``cache`` [blocks, ids, block_size, H] into their files
    through a bounded pool of host buffers. ``submit`` a request, then ``pump`` once per
    engine step (from one thread): it copies what the free buffers allow and returns the
    requests whose blocks may now be freed."""

    def __init__(self, cache: torch.Tensor, layout: StateLayout, executor: Executor,
                 chunk_blocks: int = 32, host_buffers: int = 8,
                 assembly_bytes: int = 2 << 30):
        self.cache, self.layout, self._executor = cache, layout, executor
        self._cuda = cache.is_cuda
        self.chunk_blocks = max(1, chunk_blocks)
        shape = (self.chunk_blocks, *cache.shape[1:])
        self.pool = HostPool(host_buffers, shape, cache.dtype, pin=self._cuda)
        self._staging: torch.Tensor | None = None  # CUDA: made at the first copy
        self._stream: Any = None
        self._queue: deque[Job] = deque()  # submitted, not all blocks copied yet
        self._copying: list[Job] = []      # all blocks issued, copy not yet complete (CUDA)
        self._busy: set[str] = set()       # ids of both
        self.assembly_budget = assembly_bytes
        self._assembling = 0               # bytes held by opened torch.save sinks
        self.peak_assembling = 0
        self._lock = threading.Lock()
        self.waits = 0                     # pumps that left a request holding its blocks
        self.failed = 0

    @property
    def block_size(self) -> int:
        return int(self.cache.shape[2])

    @property
    def staging_bytes(self) -> int:
        return self.pool.buffer_bytes if self._cuda else 0

    def submit(self, req_id: str, blocks: Sequence[int], n: int, sink: Sink,
               on_done: Callable[[Job, OSError | None], None]) -> None:
        need = -(-n // self.block_size)
        self._queue.append(Job(req_id, list(blocks)[:need], n, sink, on_done))
        self._busy.add(req_id)

    def busy(self, req_id: str) -> bool:
        """Whether the request still needs its blocks."""
        return req_id in self._busy

    def pending(self) -> int:
        return len(self._queue) + len(self._copying)

    def pump(self) -> set[str]:
        """Copy as many chunks as free buffers allow, first come first served; the ids of
        the requests now entirely on the host (or failed): their blocks may be freed."""
        released: set[str] = set()
        ready = False
        while self._queue:
            job = self._queue[0]
            if not job.opened and not self._admit(job):
                break
            if job.error is None and job.copied < len(job.blocks):
                buf = self.pool.take()
                if buf is None:
                    break
                if self._cuda and not ready:
                    self._wait_for_forward()
                    ready = True
                self._copy_chunk(job, buf)
            if job.error is not None or job.copied >= len(job.blocks):
                self._queue.popleft()
                self._copying.append(job)
                with job.lock:
                    job.issued_all = True
                self._maybe_settle(job)
        for job in list(self._copying):
            if job.last_event is None or job.last_event.query():
                self._copying.remove(job)
                self._busy.discard(job.req_id)
                released.add(job.req_id)
        if self._queue:
            self.waits += 1
        return released

    def drain(self) -> None:
        """Until every submitted request is on the host (tests, shutdown)."""
        while self.pending():
            if not self.pump():
                threading.Event().wait(0.001)

    # -- internals -----------------------------------------------------------------------

    def _admit(self, job: Job) -> bool:
        need = job.sink.assembly_bytes
        with self._lock:
            if need and self._assembling and self._assembling + need > self.assembly_budget:
                return False
            self._assembling += need
            self.peak_assembling = max(self.peak_assembling, self._assembling)
        job.opened = True
        try:
            job.sink.open()
        except Exception as exc:  # noqa: BLE001 - a file that cannot be opened fails alone
            self._fail(job, exc)
        return True

    def _wait_for_forward(self) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.cache.device)
        ready = torch.cuda.Event()
        ready.record()
        self._stream.wait_event(ready)

    def _copy_chunk(self, job: Job, buf: torch.Tensor) -> None:
        start = job.copied
        blocks = job.blocks[start:start + self.chunk_blocks]
        k = len(blocks)
        index = torch.tensor(blocks, dtype=torch.long)
        if self._cuda:
            if self._staging is None:
                self._staging = torch.empty_like(buf, device=self.cache.device)
            with torch.cuda.stream(self._stream):
                index = index.to(self.cache.device, non_blocking=True)
                torch.index_select(self.cache, 0, index, out=self._staging[:k])
                buf[:k].copy_(self._staging[:k], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            job.last_event = event
        else:
            torch.index_select(self.cache, 0, index, out=buf[:k])
            event = None
        job.copied += k
        with job.lock:
            job.chunks += 1
        first = start * self.block_size
        m = min(job.n, (start + k) * self.block_size) - first
        self._executor.submit(self._write_chunk, job, first, m, buf, k, event)

    def _write_chunk(self, job: Job, first: int, m: int, buf: torch.Tensor, k: int,
                     event: Any) -> None:
        """A writer thread: one chunk from its host buffer into the file. In inference mode,
        as the engine's step that made the sink's tensors (outside it, torch refuses to
        update them in place)."""
        try:
            with torch.inference_mode():
                if event is not None:
                    event.synchronize()
                if job.error is None:
                    aux, final = self.layout.tensors(buf[:k], m)
                    job.sink.write(first, aux, final)
        except BaseException as exc:  # noqa: BLE001 - the file fails, the writers go on
            self._fail(job, exc)
        finally:
            self.pool.give(buf)
            with job.lock:
                job.written += 1
            self._maybe_settle(job)

    def _fail(self, job: Job, exc: BaseException) -> None:
        with job.lock:
            if job.error is None:
                job.error = write_failure(job.sink.path, exc, getattr(job.sink, "size", 0)
                                          or job.sink.assembly_bytes)
                self.failed += 1
                log.error("request %s: %s", job.req_id, job.error.strerror)

    def _maybe_settle(self, job: Job) -> None:
        """Settle once, by whichever of the pump and the writers sees the job complete."""
        with job.lock:
            if job.settled or not job.issued_all or job.written < job.chunks:
                return
            job.settled = True
        self._settle(job)

    def _settle(self, job: Job) -> None:
        """The last chunk is written (or the file failed): commit or clean up, then tell."""
        if job.error is None:
            try:
                job.sink.commit()
            except BaseException as exc:  # noqa: BLE001
                self._fail(job, exc)
        if job.error is not None:
            job.sink.abort()
        with self._lock:
            self._assembling -= job.sink.assembly_bytes
        job.on_done(job, job.error)
