"""The files the capture connector writes, chunk by chunk, from writer threads: the capture
file (safetensors, streamed to disk at offsets its header fixes) and the extraction file
(torch.save, assembled on the host), and what a failed write tells the engine's log and the
request's reader (datagen/extraction/state_copy.py drives them; no vLLM here)."""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from datagen.extraction.files import TMP_MARK, save_atomic
from datagen.servers.capture import FAILED

ST_DTYPES = {torch.int64: "I64", torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float16: "F16"}


class Sink(Protocol):
    """One file, written chunk by chunk (from writer threads, chunks in any order)."""

    path: Path
    assembly_bytes: int  # host memory the sink holds until it commits

    def open(self) -> None: ...
    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


def _bytes(t: torch.Tensor) -> Any:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _pwrite_all(pwrite: Callable[[int, Any, int], int], fd: int, data: Any,
                offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        done = pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _temp(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_header(shapes: dict[str, tuple[torch.dtype, Sequence[int]]],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data of a safetensors file of these tensors, as safetensors'
    save_file writes them (tensors by alignment then name, metadata first, the header padded
    with spaces to 8 bytes; metadata keys sorted: save_file orders them at random), and
    each tensor's offset in the file."""
    order = sorted(shapes, key=lambda k: (-shapes[k][0].itemsize, k))
    head: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    start, offsets = 0, {}
    for key in order:
        dtype, shape = shapes[key]
        size = dtype.itemsize
        for d in shape:
            size *= int(d)
        head[key] = {"dtype": ST_DTYPES[dtype], "shape": [int(d) for d in shape],
                     "data_offsets": [start, start + size]}
        offsets[key] = start
        start += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return prefix, {k: len(prefix) + v for k, v in offsets.items()}


class SafetensorsSink:
    """The capture file (datagen/servers/capture.py's layout) streamed to disk: the header
    and ids at open, each chunk's rows written at their offsets, fsynced and renamed at
    commit. Holds no sample-sized memory."""

    assembly_bytes = 0

    def __init__(self, path: Path, token_ids: torch.Tensor, widths: tuple[int, int],
                 dtype: torch.dtype, metadata: dict[str, str] | None = None,
                 pwrite: Callable[[int, Any, int], int] = os.pwrite):
        self.path, self._ids = path, token_ids.to(torch.int64).contiguous()
        n = int(self._ids.shape[0])
        self._prefix, self._offsets = safetensors_header(
            {"input_ids": (torch.int64, [n]), "aux_hidden_state": (dtype, [n, widths[0]]),
             "hidden_state": (dtype, [n, widths[1]])}, metadata)
        self._row = {"aux_hidden_state": widths[0] * dtype.itemsize,
                     "hidden_state": widths[1] * dtype.itemsize}
        self.size = len(self._prefix) + n * (8 + sum(self._row.values()))
        self._pwrite, self._fd, self._tmp = pwrite, -1, _temp(path)

    def open(self) -> None:
        self._fd = os.open(self._tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        _pwrite_all(self._pwrite, self._fd, self._prefix, 0)
        _pwrite_all(self._pwrite, self._fd, _bytes(self._ids), self._offsets["input_ids"])

    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        for key, t in (("aux_hidden_state", aux), ("hidden_state", final)):
            _pwrite_all(self._pwrite, self._fd, _bytes(t),
                        self._offsets[key] + start * self._row[key])

    def commit(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


class TorchSink:
    """The extraction file (SpecForge's ``data_{idx}.ckpt``, torch.save): the sample's tensors
    assembled on the host, then saved whole (files.save_atomic)."""

    def __init__(self, path: Path, token_ids: torch.Tensor, loss_mask: torch.Tensor,
                 widths: tuple[int, int], dtype: torch.dtype,
                 save: Callable[[dict[str, torch.Tensor], Path], Any] = torch.save):
        self.path, self._save = path, save
        self._ids, self._mask = token_ids.to(torch.int64), loss_mask
        self._shape = (int(token_ids.shape[0]), widths, dtype)
        self.assembly_bytes = self._shape[0] * sum(widths) * dtype.itemsize
        self.size = 0
        self._aux: torch.Tensor | None = None
        self._final: torch.Tensor | None = None

    def open(self) -> None:
        n, (aux_w, final_w), dtype = self._shape
        self._aux = torch.empty(n, aux_w, dtype=dtype)
        self._final = torch.empty(n, final_w, dtype=dtype)

    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        assert self._aux is not None and self._final is not None
        self._aux[start:start + aux.shape[0]] = aux
        self._final[start:start + final.shape[0]] = final

    def commit(self) -> None:
        assert self._aux is not None and self._final is not None
        self.size = save_atomic(self.path, {
            "input_ids": self._ids, "loss_mask": self._mask,
            "aux_hidden_state": self._aux.unsqueeze(0),
            "hidden_state": self._final.unsqueeze(0)}, save=self._save)
        self._aux = self._final = None

    def abort(self) -> None:
        self._aux = self._final = None


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def write_failure(path: Path, exc: BaseException, needed: int) -> OSError:
    """What the engine's log and the request's reader are told of a failed write (its errno
    kept): for a full disk, the folder and its free space, so that it is not taken for a
    lost engine."""
    folder = path.parent
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{free_bytes(folder)} bytes free"
        except OSError:
            free = "free space unknown"
        return OSError(code, f"{path.name}: no space left on device under {folder} ({free}, "
                             f"the file needs {needed} bytes)")
    return OSError(code, f"{path.name}: write under {folder} failed: {exc!r}")


def release_lock(lock_fd: int, error: OSError | None) -> None:
    """A file's write ended: a failed one leaves its error in the held lock for the reader
    (capture.write_failure; best effort: a full disk may refuse even these bytes, the
    engine's log has it anyway), then the lock is released."""
    try:
        if error is not None:
            os.write(lock_fd, f"{FAILED}{error.errno} {error.strerror}\n".encode())
    except OSError:
        pass
    finally:
        os.close(lock_fd)
