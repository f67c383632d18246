"""Disk and time planning for hidden-state extraction (phase 2).

Every token stores 3 aux states + 1 final state of ``hidden_size`` values in the model dtype,
plus its id and loss-mask flag as int64 (16 bytes). The producer and the CLI import this
module, so it must not import torch: only ``calibrate`` does, lazily, because it runs the model.

    bytes  = tokens x (4 x H x dtype_bytes + 16)
    hours  = tokens / (tokens_per_s x n_gpus) / 3600

With ``capture_states`` the generation servers write the states while they generate: no
extraction forward (0 hours; the `captured` build step only reads and rewrites files), but the
captured files (4 x H x dtype_bytes + 8 B of ids per token, under ``<output_dir>/states``) sit
on disk beside the training folder built from them, and the states wait in each server's KV
cache until their request ends (4 x H x dtype_bytes per token).

Streamed into SpecForge's data plane (``states_to = "stream"``) the states never reach a disk:
each sample sits in the feature store from its put until the trainer's step frees it, and the
store's resident bytes stay under the bound (``stream_resident_bytes``). What it costs instead
is a forward per epoch: the states are a cache, so every epoch after the first recomputes them
by prefill from the records (and the first too, unless they were captured while generating):

    stream bytes/token = 4 x H x dtype_bytes + 24   (ids, loss mask, attention mask: int64)
    hours per epoch    = tokens / (tokens_per_s x n_gpus) / 3600
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from datagen.errors import StorageError

log = logging.getLogger(__name__)

N_AUX = 3
ID_AND_MASK_BYTES = 16  # input_ids int64 + loss_mask int64
CAPTURED_ID_BYTES = 8  # a captured file's input_ids int64 (the build step derives the mask)
STREAM_ID_BYTES = 24  # a streamed sample's input_ids, loss_mask, attention_mask: int64 [1, T]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# (hidden_size, num_hidden_layers) of targets planned for before their weights are at hand.
# Kimi-K2.5: the DeepSeek-V3 text backbone of its config.json's text_config.
PRESETS = {"kimi-k2.5": (7168, 61), "kimi-k2": (7168, 61), "deepseek-v3": (7168, 61),
           "llama-3.1-8b": (4096, 32), "llama-3.1-70b": (8192, 80)}


class InsufficientDiskSpace(StorageError):
    """The estimated output does not fit on the target filesystem."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """SpecForge's default low/mid/high layers: the *outputs* of decoder layers 1, N//2-1, N-4."""
    if num_layers < 4:
        raise ValueError(f"num_layers={num_layers}: need at least 4 decoder layers for aux ids")
    return (1, num_layers // 2 - 1, num_layers - 4)


def bytes_per_token(hidden_size: int, dtype_bytes: int = 2, n_aux: int = N_AUX) -> int:
    return (n_aux + 1) * hidden_size * dtype_bytes + ID_AND_MASK_BYTES


def estimate_bytes(tokens: int, hidden_size: int, dtype_bytes: int = 2, n_aux: int = N_AUX) -> int:
    """Bytes of tensor payload; torch.save adds ~1-2 KB per file on top, ignored here."""
    return tokens * bytes_per_token(hidden_size, dtype_bytes, n_aux)


def stream_bytes_per_token(hidden_size: int, dtype_bytes: int = 2, n_aux: int = N_AUX) -> int:
    """A streamed sample's bytes per position in the feature store (SpecForge's stream names:
    ``hidden_state`` the aux states, ``target`` the final one, three int64 id/mask rows)."""
    return (n_aux + 1) * hidden_size * dtype_bytes + STREAM_ID_BYTES


def captured_bytes_per_token(hidden_size: int, dtype_bytes: int = 2, n_aux: int = N_AUX) -> int:
    """A captured file's bytes per position (datagen/servers/capture.py's layout)."""
    return (n_aux + 1) * hidden_size * dtype_bytes + CAPTURED_ID_BYTES


@dataclass(frozen=True)
class DatasetEstimate:
    name: str
    tokens: int
    bytes: int
    hours: float


@dataclass(frozen=True)
class Stream:
    """The stream's side of a plan: what the feature store holds and what each epoch costs."""

    resident_bound: int  # stream_resident_bytes
    bytes_per_token: int
    sample_bytes: int  # one sample at train_max_length
    epochs: int
    hours_per_epoch: float  # a prefill of every token
    first_epoch_hours: float  # 0 when the states were captured while generating

    @property
    def samples_resident(self) -> int:
        """Samples of train_max_length the bound holds at once (0: not even one fits)."""
        return self.resident_bound // self.sample_bytes

    @property
    def hours(self) -> float:
        return self.first_epoch_hours + (self.epochs - 1) * self.hours_per_epoch


@dataclass(frozen=True)
class Estimate:
    datasets: tuple[DatasetEstimate, ...]
    total_tokens: int
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]
    dtype_bytes: int
    bytes_per_token: int
    total_bytes: int
    tokens_per_s_per_gpu: float
    n_gpus: int
    hours: float
    captured: bool = False
    states_bytes: int = 0  # the captured files under <output_dir>/states (capture only)
    keep_states: bool = False  # keep_captured_states: the build leaves each captured file
    in_flight_bytes: int = 0  # captured, freed: the rows being written (threads x window)
    stream: Stream | None = None  # streamed into SpecForge's data plane instead of files

    @property
    def peak_bytes(self) -> int:
        """Disk for states at the peak. Streamed: none (the feature store holds them, in
        memory, under its bound). Else the training folder and, with capture, the files it is
        built from: both when they are kept; freed, each row replaces its file once durable, so
        the larger total and the rows the writer threads hold (BENCHMARKS.md, "Peak disk of
        the `captured` build")."""
        if self.stream is not None:
            return 0
        if not self.captured or self.keep_states:
            return self.total_bytes + self.states_bytes
        return max(self.total_bytes, self.states_bytes) + self.in_flight_bytes

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def text(self) -> str:
        return render(self)


def estimate(tokens_by_dataset: Mapping[str, int], hidden_size: int, num_layers: int,
             tokens_per_s: float, n_gpus: int = 1, dtype_bytes: int = 2,
             captured: bool = False, keep_states: bool = False,
             rows_in_flight: int = 4, max_length: int = 2048,
             stream_bound: int | None = None, epochs: int = 1) -> Estimate:
    """Plan a run: bytes and hours per dataset and in total. ``captured``: the states come
    from the generation pass (capture_states): no forward hours, ``tokens_per_s`` unused, and
    the captured files counted apart (``states_bytes``); ``keep_states``
    (keep_captured_states), ``rows_in_flight`` (extract_writer_threads) and ``max_length``
    (train_max_length) give the peak of the build. ``stream_bound``
    (stream_resident_bytes): the states stream into SpecForge's data plane, ``epochs`` times,
    each epoch after a captured first one recomputed by prefill at ``tokens_per_s``."""
    if epochs < 1:
        raise ValueError(f"epochs={epochs} must be >= 1")
    recomputes = stream_bound is not None and (epochs > 1 or not captured)
    if n_gpus <= 0 or (tokens_per_s <= 0 and (recomputes or not captured)):
        raise ValueError(f"tokens_per_s={tokens_per_s} and n_gpus={n_gpus} must be > 0"
                         + (": the stream recomputes the states by prefill every epoch after "
                            "the first" if recomputes and captured else ""))
    rate = tokens_per_s * n_gpus

    def hours(tokens: int) -> float:
        return 0.0 if captured else tokens / rate / 3600

    per = tuple(
        DatasetEstimate(name, int(tok), estimate_bytes(int(tok), hidden_size, dtype_bytes),
                        hours(int(tok)))
        for name, tok in tokens_by_dataset.items()
    )
    total = sum(d.tokens for d in per)
    stream = None
    if stream_bound is not None:
        per_token = stream_bytes_per_token(hidden_size, dtype_bytes)
        prefill = total / rate / 3600 if rate > 0 else 0.0
        stream = Stream(resident_bound=stream_bound, bytes_per_token=per_token,
                        sample_bytes=max_length * per_token, epochs=epochs,
                        hours_per_epoch=prefill, first_epoch_hours=hours(total))
    return Estimate(
        datasets=per, total_tokens=total, hidden_size=hidden_size, num_layers=num_layers,
        aux_layer_ids=default_aux_layer_ids(num_layers), dtype_bytes=dtype_bytes,
        bytes_per_token=bytes_per_token(hidden_size, dtype_bytes),
        total_bytes=estimate_bytes(total, hidden_size, dtype_bytes),
        tokens_per_s_per_gpu=tokens_per_s, n_gpus=n_gpus, hours=hours(total),
        captured=captured,
        states_bytes=total * captured_bytes_per_token(hidden_size, dtype_bytes) if captured else 0,
        keep_states=keep_states,
        in_flight_bytes=estimate_bytes(rows_in_flight * max_length, hidden_size, dtype_bytes),
        stream=stream,
    )


def _size(n: float) -> str:
    """Bytes in the unit the totals line uses: TB from 1 TB up, else GB."""
    return f"{n / 1e12:,.2f} TB" if n >= 1e12 else f"{n / 1e9:,.1f} GB"


def render(est: Estimate) -> str:
    """Human-readable plan that spells out the arithmetic so it can be checked by hand."""
    h, d = est.hidden_size, est.dtype_bytes
    # streamed, the files' bytes are what the file build would write: none reach the disk
    disk = "as files" if est.stream is not None else "disk"
    lines = [
        f"aux layers {list(est.aux_layer_ids)} of {est.num_layers} (outputs) + final norm",
        f"bytes/token = (3 aux + 1 final) x H {h} x {d} B = {(N_AUX + 1) * h * d:,} B of states"
        f" + {ID_AND_MASK_BYTES} B (ids, mask) = {est.bytes_per_token:,} B",
        f"{'dataset':<24}{'tokens':>16}{disk:>16}{'hours':>10}",
    ]
    for ds in est.datasets:
        lines.append(f"{ds.name:<24}{ds.tokens:>16,}{_size(ds.bytes):>16}{ds.hours:>10.2f}")
    lines += [
        f"{'total':<24}{est.total_tokens:>16,}{_size(est.total_bytes):>16}{est.hours:>10.2f}",
        f"{disk:<5} = {est.total_tokens:,} tokens x {est.bytes_per_token:,} B"
        f" = {est.total_bytes:,} B = {_size(est.total_bytes)}",
    ]
    if est.stream is not None:
        return "\n".join(lines + _stream_lines(est, est.stream))
    return "\n".join(lines + (_captured_lines(est) if est.captured else [
        f"time  = {est.total_tokens:,} tokens / ({est.tokens_per_s_per_gpu:,.0f} tokens/s"
        f" x {est.n_gpus} GPUs) / 3600 = {est.hours:,.1f} h"]))


def _stream_lines(est: Estimate, st: Stream) -> list[str]:
    h, d = est.hidden_size, est.dtype_bytes
    first = ("0 h (states captured while generating)" if est.captured
             else f"{st.first_epoch_hours:,.1f} h")
    fits = (f"{st.samples_resident:,} samples of train_max_length "
            f"({st.sample_bytes / 1e9:,.2f} GB each)" if st.samples_resident else
            f"NOT ONE sample of train_max_length ({st.sample_bytes / 1e9:,.2f} GB): raise "
            "stream_resident_bytes")
    return [
        "stream: the states go into SpecForge's feature store, not to disk (states_to = stream)",
        f"stream bytes/token = {(N_AUX + 1) * h * d:,} B of states + {STREAM_ID_BYTES} B (ids,"
        f" loss and attention masks) = {st.bytes_per_token:,} B",
        f"resident <= {_size(st.resident_bound)} in the store (stream_resident_bytes): {fits}",
        "disk for states = 0 B: the file build's bytes above are never written",
        f"prefill per epoch = {est.total_tokens:,} tokens / ({est.tokens_per_s_per_gpu:,.0f} "
        f"tokens/s x {est.n_gpus} GPUs) / 3600 = {st.hours_per_epoch:,.1f} h",
        f"epochs = {st.epochs}: the first {first}, each further one a prefill from the records"
        f" ({st.hours_per_epoch:,.1f} h) = {st.hours:,.1f} h of forward in all",
    ]


def _captured_lines(est: Estimate) -> list[str]:
    h, d = est.hidden_size, est.dtype_bytes
    per = captured_bytes_per_token(h, d)
    return [
        f"states = {est.total_tokens:,} tokens x {per:,} B ((3 aux + 1 final) x H {h} x {d} B"
        f" + {CAPTURED_ID_BYTES} B ids) = {est.states_bytes:,} B = {_size(est.states_bytes)}",
        "        captured under <output_dir>/states (the positions inside train_max_length "
        "only: the connector cuts there)",
        _peak_line(est),
        "time  = 0 h of extraction forward: capture_states wrote the states while generating "
        "(the `captured` build step reads and rewrites them, disk-bound)",
        f"KV    = {(N_AUX + 1) * h * d:,} B per token of states beside the attention cache in "
        f"every generation server until its request ends: fewer requests fit",
    ]


def _peak_line(est: Estimate) -> str:
    if est.keep_states:
        return (f"peak  = {_size(est.total_bytes)} + {_size(est.states_bytes)} = "
                f"{_size(est.peak_bytes)}: the training folder and the captured files it is "
                "built from (keep_captured_states = true keeps both)")
    return (f"peak  = max({_size(est.total_bytes)} rows, {_size(est.states_bytes)} states) + "
            f"{_size(est.in_flight_bytes)} of rows being written = {_size(est.peak_bytes)}: "
            "each captured file is freed once its row is durable (keep_captured_states = "
            "false)")


def _existing_parent(path: Path) -> Path:
    # The output folder may not exist yet; its filesystem is that of the nearest existing parent.
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(output_dir: str | Path, tokens: int, hidden_size: int, dtype_bytes: int = 2,
               override: bool = False) -> int:
    """Raise InsufficientDiskSpace when the estimate exceeds free space; returns needed bytes."""
    need = estimate_bytes(tokens, hidden_size, dtype_bytes)
    where = _existing_parent(Path(output_dir))
    free = shutil.disk_usage(where).free
    if need > free:
        msg = (f"need {need / 1e9:,.1f} GB for {tokens:,} tokens, {free / 1e9:,.1f} GB free at "
               f"{where}; pass --force to override")
        if not override:
            raise InsufficientDiskSpace(msg)
        log.warning("disk check overridden: %s", msg)
    return need


@dataclass(frozen=True)
class Calibration:
    model_path: str
    device_name: str
    tokens_per_s: float
    measured_at: float


def save_calibration(path: str | Path, model_path: str, device_name: str,
                     tokens_per_s: float) -> Calibration:
    cal = Calibration(model_path, device_name, float(tokens_per_s), time.time())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(asdict(cal), indent=2) + "\n")
    return cal


def load_calibration(path: str | Path) -> Calibration:
    data = json.loads(Path(path).read_text())
    return Calibration(str(data["model_path"]), str(data["device_name"]),
                       float(data["tokens_per_s"]), float(data.get("measured_at", 0.0)))
