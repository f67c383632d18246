"""Phase 2: run the target model over prompt+response ids, write SpecForge offline files.

One ``Extractor`` per GPU process loads the model once; the Celery task calls ``run_shard``
for each shard of phase-1 records. Per sample it writes ``data_{idx}.ckpt`` =
{input_ids int64 [L], loss_mask int64 [L], aux_hidden_state [1, L, 3H], hidden_state [1, L, H]}
(see files.py for layout and crash safety, backends/hf.py for hooks and packing,
pipeline.py for the overlap of compute, copies and writes).

Batching (batching.py): a shard's samples are sorted by length (longest first) and cut into
batches of at most ``batch_tokens`` tokens; a batch is the unit of retry and of one
device->host copy. Inside a batch, consecutive samples share a row (one forward call, no
padding) up to ``pack_tokens``. A failing batch (CUDA OOM or any error) is split in halves
down to single samples; a single sample that still fails is reported in
``ShardResult.failures`` for the caller to dead-letter. In a replica of several ranks a failing
forward ends the replica instead (replica.py): the ranks cannot skip a row in step.
"""

from __future__ import annotations

import itertools
import logging
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from datagen.errors import EngineLost, StorageError, StreamUnavailable
from datagen.extraction import backends, tolerance
from datagen.extraction.backends.base import text_config
from datagen.extraction.backends.hf import (
    DTYPES,
    HFBackend,
    aux_ids_for,
    packing_isolated,
    resolve_device,
)
from datagen.extraction.backends.vllm import EngineOptions
from datagen.extraction.batching import length_batches, longest_first, pack_rows
from datagen.extraction.estimate import DTYPE_BYTES, check_disk
from datagen.extraction.files import (
    Rejected,
    Sample,
    counted_ids,
    prepare,
    read_shard,
    relative_path,
    remove_stale_temps,
    sample_loss_mask,
    sample_tensors,
    save_atomic,
)
from datagen.extraction.integrity import (
    Checked,
    CheckTally,
    StateCheck,
    StateCheckFailed,
    require_finite,
)
from datagen.extraction.manifest import Manifest, check_metadata, load_done, shard_name
from datagen.extraction.pipeline import AsyncWriter, Countdown, HostStaging, Staged
from datagen.extraction.recapture import Recapture
from datagen.stream.sink import StreamSink, open_sink
from datagen.training import vocab_mapping as vm

__all__ = ["ExtractionConfig", "Extractor", "SampleFailure", "ShardResult", "check_disk"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (samples handled so far, samples in shard)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
STATES_TO = ("files", "stream")


@dataclass(frozen=True)
class ExtractionConfig:
    model_path: str
    output_dir: str
    aux_layer_ids: tuple[int, ...] | None = None  # None: SpecForge's [1, N//2-1, N-4]
    dtype: str = "bfloat16"
    device: str = "auto"
    max_length: int = 2048       # the settings' train_max_length
    overlong: str = "truncate"   # or "skip"
    batch_tokens: int = 32768
    pack_tokens: int | None = None  # None: whole batch with flash varlen, else 4096 (see model)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    writer_threads: int = 4
    max_pending_writes: int = 8
    check_free_space: bool = True
    force: bool = False          # write even when the disk check says it will not fit
    backend: str = "hf"          # backends.NAMES
    engine: EngineOptions = field(default_factory=EngineOptions)  # the `vllm` backend's
    run_dir: str = ""            # the run's output_dir: what a shard line's `states` is under
    check_states: bool = True    # final states against the record's logprobs (integrity.py)
    check_positions_cpu: int = 32  # positions per sample on a CPU; all on a GPU; 0: all
    check_atol_nats: float = 0.01
    server_dtype: str = "auto"   # the generation server's dtype (tolerance.py); auto: the model's
    recapture_share: float = 0.0  # captured: samples re-captured on server_url (recapture.py)
    server_url: str = ""         # the generation server (recapture_share)
    api_key: str | None = None
    keep_captured_states: bool = False  # captured: keep each file its row was built from
    states_to: str = "files"     # "stream": each sample into SpecForge's feature store (sink.py)
    stream_dir: str = ""         # the plane's folder (plane.json) when states_to = "stream"
    stream_resident_bytes: int = 8 << 30  # the stream's bound on bytes not yet acknowledged
    epoch: int = 1               # the stream's epoch: sample ids end in @e<epoch>
    shuffle_seed: int = 0        # epochs after the first: their batches' order is seeded by it
    redis_url: str = ""          # the stream's ledger (states_to = "stream")

    def __post_init__(self) -> None:
        choices = {"dtype": DTYPES, "overlong": ("truncate", "skip"), "backend": backends.NAMES,
                   "server_dtype": ("auto", *tolerance.DTYPES), "states_to": STATES_TO}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {list(allowed)}")
        for name in ("max_length", "batch_tokens", "writer_threads", "max_pending_writes",
                     "stream_resident_bytes", "epoch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")

    def resolved_pack_tokens(self) -> int:
        if self.pack_tokens is not None:
            return self.pack_tokens
        return self.batch_tokens if self.attn_implementation in VARLEN_ATTENTION else 4096


@dataclass(frozen=True)
class SampleFailure:
    idx: int | None
    id: str
    reason: str
    check: Checked | None = None  # a failed state check: what it measured


@dataclass
class ShardResult:
    shard: str
    written: int = 0
    skipped_done: int = 0
    skipped_overlong: int = 0
    truncated: int = 0
    tokens: int = 0               # tokens written by this run
    bytes: int = 0                # bytes written by this run
    seconds: float = 0.0
    failures: list[SampleFailure] = field(default_factory=list)
    overlong_ids: list[str] = field(default_factory=list)
    check: CheckTally = field(default_factory=CheckTally)  # the state check of this run


@dataclass
class _ShardRun:
    """Per-shard state shared by the forward loop and the writer threads."""

    result: ShardResult
    manifest: Manifest | None = None
    pending: list[tuple[Sample, Future]] = field(default_factory=list)
    kept: list[tuple[str, Sample]] = field(default_factory=list)  # (file, sample) on disk
    checks: list[Checked] = field(default_factory=list)  # state checks passed (list: atomic)
    total: int = 0
    handled: int = 0


class Extractor:
    def __init__(self, cfg: ExtractionConfig, model: Any | None = None,
                 backend: Any | None = None, sink: StreamSink | None = None):
        """The model comes from ``backend`` (a base.Backend, e.g. a replica's leader), else
        ``model`` (already built; the `hf` backend wraps it), else cfg.backend loads it.
        With states_to = "stream" the states go to ``sink`` (else the plane's, opened here)."""
        self.cfg = cfg
        if sink is None and cfg.states_to == "stream":
            sink = open_sink(cfg.stream_dir, cfg.redis_url, cfg.epoch, cfg.stream_resident_bytes)
        self.sink = sink
        self.device = resolve_device(cfg.device)
        if model is not None and cfg.device == "auto":  # an already-built model stays put
            self.device = next(model.parameters()).device
        self.dtype = DTYPES[cfg.dtype]
        if backend is None and model is not None:
            backend = HFBackend(model.eval(), aux_ids_for(model, cfg.aux_layer_ids),
                                self.device)
        if backend is None:
            backend = backends.create(cfg.backend, cfg, self.device)
        self.runner = backend
        self.device = backend.device
        self.model = getattr(backend, "model", None)
        self.aux_layer_ids = tuple(backend.aux_layer_ids)
        self.hidden_size = backend.hidden
        self.vocab_size = backend.vocab_size
        # an engine that writes each file itself (vllm): requests in flight, no host staging
        self.writes_files = bool(getattr(backend, "writes_files", False))
        self.pack_tokens = 0 if self.writes_files else self._check_packing(
            cfg.resolved_pack_tokens())
        self.staging = None if self.writes_files else HostStaging(
            self.device, backend.width, self.dtype, max(cfg.batch_tokens, cfg.max_length))
        self.state_check = self._state_check(backend)
        self.recapture = self._recapture()
        if self.writes_files:
            self.writer = AsyncWriter(backend.inflight, backend.inflight)
        else:
            self.writer = AsyncWriter(cfg.writer_threads, cfg.max_pending_writes)
        log.info("extractor ready (%s): H=%d, aux layers %s of %d, %s on %s, pack_tokens=%d",
                 cfg.backend, self.hidden_size, list(self.aux_layer_ids), backend.num_layers,
                 cfg.dtype, self.device, self.pack_tokens)

    def _state_check(self, backend: Any) -> StateCheck | None:
        """The check of each sample's final states against its record's logprobs, run on
        this extractor's device (an engine backend's rows are read back from its file)."""
        cfg = self.cfg
        if not cfg.check_states:
            return None
        model = getattr(backend, "model", None)
        head = model.get_output_embeddings() if model is not None else None
        allowed = tolerance.for_extraction(cfg.backend, cfg.server_dtype, self._text_config())
        if head is not None:
            return StateCheck(head.weight.detach(), self.device, cfg.check_atol_nats,
                              cfg.check_positions_cpu, allowed)
        return StateCheck.for_model(cfg.model_path, self.device, cfg.check_atol_nats,
                                    cfg.check_positions_cpu, allowed)

    def _text_config(self) -> dict[str, Any]:
        """The checkpoint's text config, else an already-built model's (benchmarks build
        random weights with no checkpoint), else nothing known."""
        if (Path(self.cfg.model_path) / "config.json").is_file():
            return text_config(self.cfg.model_path)
        config = getattr(self.model, "config", None)
        found = config.to_dict() if config is not None else {}
        return found.get("text_config") or found

    def _recapture(self) -> Recapture | None:
        """The `captured` build's cross-check of a share of samples against a prefill of
        their ids on the generation server (recapture.py)."""
        cfg = self.cfg
        if cfg.backend != "captured" or cfg.recapture_share <= 0 or not cfg.server_url:
            return None
        config = self._text_config()  # a prefill is a second forward: recompute's
        allowed = tolerance.Tolerance(tolerance.server_dtype(cfg.server_dtype, config),
                                      "recompute", tolerance.is_moe(config))
        return Recapture(cfg.server_url, cfg.run_dir or ".", cfg.recapture_share,
                         self.aux_layer_ids, allowed, cfg.api_key)

    def check(self, s: Sample, aux: torch.Tensor, final: torch.Tensor) -> Checked | None:
        """Sample ``s``'s states (aux [n, 3H], final [n, H]): all finite (checked whether
        check_states is on or not), final against its logprobs, and for the samples
        recapture_share picks every layer against a prefill on the server; StateCheckFailed
        otherwise. None when check_states is off and the sample was not re-captured."""
        checked = None
        if self.state_check is None:
            require_finite(aux, final)
        else:
            checked = self.state_check.check(s, final, aux)
        if self.recapture is not None and self.recapture.wanted(s) and \
                self.recapture.check(s, aux, final):
            checked = replace(checked or Checked(0, 0.0, -1, 0.0), recaptured=True)
        return checked

    def metadata(self) -> dict[str, Any]:
        """What the files are (written to <extraction_dir>/extraction.json)."""
        import os

        return {"model_path": str(Path(self.cfg.model_path).resolve()) if self.cfg.model_path
                else "", "aux_layer_ids": list(self.aux_layer_ids),
                "num_layers": int(self.runner.num_layers), "hidden_size": self.hidden_size,
                "dtype": self.cfg.dtype, "backend": self.cfg.backend,
                "ranks": int(os.environ.get("WORLD_SIZE", 1))}

    @classmethod
    def from_model(cls, model: Any, cfg: ExtractionConfig) -> Extractor:
        """Use an already-built model (benchmarks build random weights directly on the GPU)."""
        return cls(cfg, model=model)

    def _check_packing(self, pack_tokens: int) -> int:
        if not self.runner.packs:
            return 0
        if pack_tokens <= 1 or packing_isolated(self.runner, self.vocab_size, self.dtype):
            return pack_tokens
        log.warning("this model/attention (%s) does not isolate packed samples: one row per "
                    "sample", self.cfg.attn_implementation)
        return 0

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        self.writer.close()
        self.runner.close()

    def __enter__(self) -> Extractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forward -------------------------------------------------------------------------

    def _rows(self, lengths: Sequence[int]) -> list[int]:
        return pack_rows(lengths, self.pack_tokens)

    def _forward_batch(self, id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """[sum(L), 4H] on the device: per sample its rows, in order (aux low|mid|high|final)."""
        total = sum(len(ids) for ids in id_lists)
        buf = torch.empty(total, self.runner.width, dtype=self.dtype, device=self.device)
        off, i = 0, 0
        for count in self._rows([len(ids) for ids in id_lists]):
            row = id_lists[i:i + count]
            n = sum(len(ids) for ids in row)
            self.runner.forward_row(row, buf[off:off + n])
            off, i = off + n, i + count
        return buf

    def forward_states(self, id_lists: Sequence[Sequence[int]]
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [1, L, 3H], final [1, L, H]) on the CPU for each sample, run as one batch."""
        host = self._forward_batch(id_lists).cpu()
        split = self.runner.n_aux * self.hidden_size
        out, off = [], 0
        for ids in id_lists:
            part = host[off:off + len(ids)]
            out.append((part[:, :split].unsqueeze(0).clone(), part[:, split:].unsqueeze(0).clone()))
            off += len(ids)
        return out

    def measure_forward(self, seq_len: int, n_batches: int, warmup: int = 1) -> float:
        """Tokens/s of the forward alone (hooks + final norm) on random ids of one length."""
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, self.vocab_size, (seq_len,), generator=g).tolist()
                   for _ in range(warmup + n_batches)]
        for ids in batches[:warmup]:
            self._forward_batch([ids])
        self._sync()
        t0 = time.perf_counter()
        for ids in batches[warmup:]:
            self._forward_batch([ids])
        self._sync()
        return seq_len * n_batches / (time.perf_counter() - t0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- shard ---------------------------------------------------------------------------

    def run_shard(self, shard_path: str | Path, progress: Progress | None = None) -> ShardResult:
        t0 = time.perf_counter()
        out_dir = Path(self.cfg.output_dir)
        run = _ShardRun(ShardResult(shard=str(shard_path)))
        todo = self._plan(shard_path, out_dir, run)
        if todo:
            check_metadata(out_dir, self.metadata())
            if self.sink is None:  # a stream's done list is its ledger
                run.manifest = Manifest(out_dir, shard_name(shard_path))
            try:
                for batch in self._batches(todo, shard_path):
                    self._run_batch(batch, run)
                    run.handled += len(batch)
                    if progress is not None:
                        progress(run.handled, run.total)
            finally:
                self._collect(run)
                if run.manifest is not None:
                    run.manifest.close()
        self._write_counts(out_dir, shard_path, run)
        run.result.seconds = time.perf_counter() - t0
        log.info("shard %s: %d written (%d tokens), %d done before, %d overlong, %d failed, "
                 "%.1fs", shard_path, run.result.written, run.result.tokens,
                 run.result.skipped_done, run.result.skipped_overlong,
                 len(run.result.failures), run.result.seconds)
        return run.result

    def _write_counts(self, out_dir: Path, shard_path: str | Path, run: _ShardRun) -> None:
        """Token counts of every file this shard has, for vocab_mapping.pt: gathered from the
        ids in memory, so the mapping never needs another pass over the files."""
        counts = vm.count_samples((path, *counted_ids(s)) for path, s in run.kept)
        vm.write_shard_counts(out_dir, shard_name(shard_path), counts, {
            "shard": str(shard_path), "samples": len(run.kept),
            "aux_layer_ids": list(self.aux_layer_ids), "hidden_size": self.hidden_size,
            "max_length": self.cfg.max_length, "overlong": self.cfg.overlong,
            "dtype": self.cfg.dtype})

    def _plan(self, shard_path: str | Path, out_dir: Path, run: _ShardRun) -> list[Sample]:
        """Validate, drop what is done, clean temps of the rest, check the disk."""
        res, cfg = run.result, self.cfg
        done = self._done(out_dir)
        todo: list[Sample] = []
        for line, rec in read_shard(shard_path):
            s = prepare(line, rec, cfg.max_length, cfg.overlong, self.vocab_size,
                        captured=cfg.backend == "captured")
            if isinstance(s, Rejected):
                if s.overlong:
                    res.skipped_overlong += 1
                    res.overlong_ids.append(s.id)
                else:
                    res.failures.append(SampleFailure(s.idx, s.id, s.reason))
            elif self._done_before(s, done, out_dir):
                res.skipped_done += 1
                run.kept.append((self._name(s, done), s))
                self._recorded(s, self._name(s, done))  # freed here if a crash came before
            else:
                res.truncated += s.truncated
                todo.append(s)
        run.total = len(todo) + res.skipped_done
        run.handled = res.skipped_done
        if todo:
            removed = remove_stale_temps(out_dir, (s.idx for s in todo))
            if removed:
                log.warning("removed %d temp files left by an interrupted run", removed)
            if cfg.check_free_space and self.sink is None:
                check_disk(out_dir, sum(s.length for s in todo), self.hidden_size,
                           DTYPE_BYTES[cfg.dtype], override=cfg.force)
        return todo

    def _done(self, out_dir: Path) -> dict[str, str]:
        """Sample key -> its file (the manifest), or a stream's published ids -> themselves."""
        if self.sink is None:
            return load_done(out_dir)
        return {sid: sid for sid in self.sink.ledger.published_ids()}

    def _name(self, s: Sample, done: dict[str, str] | None = None) -> str:
        """Where the sample's states went: its file, or its stream id."""
        if self.sink is not None:
            return self.sink.sample_id(s.dataset, s.id)
        return done[s.key] if done is not None and s.key in done else relative_path(s.idx)

    def _done_before(self, s: Sample, done: dict[str, str], out_dir: Path) -> bool:
        if self.sink is not None:
            return self._name(s) in done
        return s.key in done and (out_dir / done[s.key]).is_file()

    def _batches(self, samples: list[Sample], shard_path: str | Path = "") -> list[list[Sample]]:
        """Longest first; an epoch after the first in an order seeded by the epoch and the
        shard, so the trainer does not see the samples in the first epoch's order. Only the
        order changes: each batch holds the same samples in every epoch, and _run_batch lays
        them out for the forward as the first epoch does, so a recomputed state is the first
        epoch's byte for byte (the same shapes through the same kernels)."""
        batches = length_batches(samples, self.cfg.batch_tokens)
        if self.cfg.epoch > 1:
            seed = f"{self.cfg.shuffle_seed}:{self.cfg.epoch}:{shard_name(shard_path)}"
            rng = random.Random(seed)
            rng.shuffle(batches)
            for batch in batches:
                rng.shuffle(batch)
        return batches

    def _run_batch(self, batch: list[Sample], run: _ShardRun) -> None:
        if self.writes_files:
            for s in batch:
                run.pending.append((s, self.writer.submit(self._engine_sample, s, run)))
            return
        layout = sorted(batch, key=longest_first)  # every epoch's, see _batches
        try:
            buf = self._forward_batch([s.input_ids for s in layout])
        except Exception as exc:  # noqa: BLE001 - any per-batch error: split and retry
            self._on_batch_error(layout, run, exc)
            return
        staged = self.staging.stage(buf)
        del buf
        countdown = Countdown(len(batch), staged.release)
        starts = itertools.accumulate((s.length for s in layout), initial=0)  # one too many
        offsets = dict(zip((s.idx for s in layout), starts, strict=False))
        for s in batch:  # written (and published) in the epoch's order
            fut = self.writer.submit(self._write_sample, s, staged, offsets[s.idx], countdown,
                                     run)
            run.pending.append((s, fut))

    def _on_batch_error(self, batch: list[Sample], run: _ShardRun, exc: Exception) -> None:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        if len(batch) == 1:
            s = batch[0]
            reason = f"forward failed: {type(exc).__name__}: {exc}"[:500]
            log.error("sample idx=%d id=%r (%d tokens): %s", s.idx, s.id, s.length, reason)
            run.result.failures.append(SampleFailure(s.idx, s.id, reason))
            return
        log.warning("batch of %d samples (%d tokens) failed (%s): splitting", len(batch),
                    sum(s.length for s in batch), type(exc).__name__)
        half = len(batch) // 2
        self._run_batch(batch[:half], run)
        self._run_batch(batch[half:], run)

    def _write_sample(self, s: Sample, staged: Staged, off: int, countdown: Countdown,
                      run: _ShardRun) -> int:
        """Runs in a writer thread: copy out of the shared buffer, save, then record."""
        try:
            staged.wait()
            part = staged.host[off:off + s.length]
            split = self.runner.n_aux * self.hidden_size
            # own storage per tensor: torch.save of a view would write the whole batch buffer
            aux = torch.empty((1, s.length, split), dtype=self.dtype)
            aux[0].copy_(part[:, :split])
            final = torch.empty((1, s.length, self.hidden_size), dtype=self.dtype)
            final[0].copy_(part[:, split:])
        finally:
            countdown.done()
        checked = self.check(s, aux[0], final[0])
        rel = self._name(s)
        size = self._store(s, rel, sample_tensors(s, aux, final))
        self._record(run, s, rel, checked)
        return size

    def _store(self, s: Sample, name: str, tensors: dict[str, torch.Tensor]) -> int:
        """The checked sample's tensors into its file, or into the stream (sink.py)."""
        if self.sink is not None:
            return self.sink.put(name, tensors)
        return save_atomic(Path(self.cfg.output_dir) / name, tensors)

    @staticmethod
    def _record(run: _ShardRun, s: Sample, rel: str, checked: Checked | None) -> None:
        """The sample's manifest line, with what its state check measured."""
        entry: dict[str, Any] = {"idx": s.idx, "id": s.id, "dataset": s.dataset, "path": rel,
                                 "tokens": s.length}
        if checked is not None:
            entry.update(checked=checked.positions, gap=round(checked.gap, 6))
            if checked.recaptured:
                entry["recaptured"] = True
            run.checks.append(checked)
        if run.manifest is not None:  # a stream's record is its ledger (sink.py)
            run.manifest.append(entry)

    def _engine_sample(self, s: Sample, run: _ShardRun) -> int:
        """Runs in a request thread: the engine (or the captured file's reader) writes the
        file, then it is recorded."""
        path = Path(self.cfg.output_dir) / relative_path(s.idx)
        found: list[Checked | None] = []
        size = self.runner.extract(
            s, sample_loss_mask(s), path,
            lambda aux, final: found.append(self.check(s, aux, final)))
        if self.sink is not None:
            size = self._publish_file(s, path)
        rel = self._name(s)
        self._record(run, s, rel, found[0] if found else None)
        self._recorded(s, rel)
        return size

    def _publish_file(self, s: Sample, path: Path) -> int:
        """A stream's sample the engine wrote (checked): read, put, deleted. It lives on
        disk only until it is published."""
        assert self.sink is not None
        tensors = torch.load(path, weights_only=True)
        size = self.sink.put(self._name(s), tensors)
        path.unlink()
        return size

    def _recorded(self, s: Sample, rel: str) -> None:
        """The row is durable (file fsynced, manifest line written): the backend may free
        what it was built from (captured: the generation pass's file)."""
        recorded = getattr(self.runner, "recorded", None)
        if recorded is not None:
            recorded(s, rel)

    def _collect(self, run: _ShardRun) -> None:
        """Wait for the writers; count successes; disk errors fail the shard (retryable by
        the caller: what was written stays done), anything else fails the sample."""
        self.writer.drain()
        storage_errors: list[BaseException] = []
        lost: list[BaseException] = []
        for s, fut in run.pending:
            exc = fut.exception()
            if isinstance(exc, EngineLost | StreamUnavailable):  # the shard is retried
                lost.append(exc)
            elif exc is None:
                run.result.written += 1
                run.kept.append((self._name(s), s))
                run.result.tokens += s.length
                run.result.bytes += fut.result()
            elif isinstance(exc, OSError):
                storage_errors.append(exc)
            elif isinstance(exc, StateCheckFailed):
                run.result.check.add(exc.result, failed=True)
                log.error("sample idx=%d id=%r: %s", s.idx, s.id, exc)
                run.result.failures.append(SampleFailure(s.idx, s.id,
                                                         f"state check: {exc}"[:500],
                                                         exc.result))
            else:
                run.result.failures.append(SampleFailure(s.idx, s.id,
                                                         f"write failed: {exc!r}"[:500]))
        run.pending.clear()
        for checked in run.checks:
            run.result.check.add(checked, failed=False)
        run.checks.clear()
        if lost:  # not the samples' fault: the shard is retried, what was written stays done
            raise lost[0]
        if storage_errors:
            raise StorageError(f"{len(storage_errors)} files could not be written under "
                               f"{self.cfg.output_dir}: {storage_errors[0]}"
                               ) from storage_errors[0]


def calibrate(model_path: str, seq_len: int = 4096, n_batches: int = 4,
              device: str = "auto", dtype: str = "bfloat16") -> float:
    """Tokens/s of the extraction forward (hooks + final norm, no LM head) on random ids,
    for `datagen calibrate`; the result is stored and used by `datagen estimate`."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ExtractionConfig(model_path=model_path, output_dir=tmp, device=device, dtype=dtype,
                               max_length=max(seq_len, 1), batch_tokens=max(seq_len, 1))
        rate = Extractor(cfg).measure_forward(seq_len, n_batches)
    log.info("calibrated %s: %.0f tokens/s at seq_len %d", model_path, rate, seq_len)
    return rate
