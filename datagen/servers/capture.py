"""Hidden states captured by the vLLM generation server while it generates (`capture_states`).

With capture on, each generate request carries ``kv_transfer_params`` naming a file of its
own under ``<output_dir>/states/<dataset>/<rid>.safetensors``; the server's connector
(datagen/extraction/vllm_connector.py, ``CaptureConnector``) writes there, once the request
ended, the states of every position the engine ran (the prompt and the generated tokens, the
last generated one excepted: it was never an input) up to ``train_max_length`` (the window:
positions past it never train, and with ``cap_to_window`` off a response may run past it):

    input_ids        int64 [L]        (prompt_ids + output_ids[:-1])[:train_max_length]
    aux_hidden_state dtype [L, 3H]    the aux layers' outputs, low | mid | high
    hidden_state     dtype [L, H]     the final RMSNorm over the last layer's output (post-norm,
                                      as SpecForge stores it: the build step applies nothing)

(safetensors: the worker checks a file from its header and its ids alone, without torch). The
file is renamed into place whole; ``<file>.lock`` is flocked from before the answer until the
write ended, written or not. The worker waits for the lock, checks the file against the ids
it holds and names it in its record before the commit; the training folder is built from the
files the committed records name (``extract_backend = "captured"``), nothing else.

This module is the part both sides share and imports no torch: the names, the check, the
wait, and the server's capture arguments.
"""

from __future__ import annotations

import fcntl
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.errors import StatesNotShared

STATES_DIR = "states"
SUFFIX = ".safetensors"
CONNECTOR = "CaptureConnector"
CONNECTOR_MODULE = "datagen.extraction.vllm_connector"
LOCK_POLL_S = 0.01
KEYS = ("input_ids", "aux_hidden_state", "hidden_state")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
MEDIA = ("image", "video", "vision_chunk")  # Kimi-K2.5's media kinds in vLLM
BUILT = ".built"  # a file the `captured` build consumed (release)
FAILED = "error "  # a lock whose write failed holds "error <errno> <reason>" (the connector's)


class CaptureMismatch(ValueError):
    """The file is there but is not the sample's states (other ids, shapes, a short file)."""


def states_path(output_dir: str | Path, dataset: str, rid: str) -> Path:
    """The attempt's file: named by its rid, so a re-run never meets an older attempt's."""
    return Path(output_dir).resolve() / STATES_DIR / dataset / f"{rid}{SUFFIX}"


def request_params(path: Path, window: int = 0) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a generate request whose states go to ``path``; with a
    ``window`` (train_max_length), the connector writes the first ``window`` positions only:
    the others never train (``cap_to_window`` off lets a response run past it)."""
    params: dict[str, Any] = {"hidden_states_path": str(path), "include_output_tokens": True}
    if window:
        params["keep_positions"] = int(window)
    return params


def vllm_capture(aux_ids: Sequence[int], num_layers: int) -> tuple[list[int], list[int]]:
    """vLLM's capture ids for this project's aux layers, and where each stored state is among
    them. vLLM's id j is the input of layer j, so the output of layer i is id i+1, and id N
    (the last layer's pre-norm output) gives the final state. vLLM keeps one state per distinct
    id, in layer order; the file keeps the aux layers in ``aux_ids`` order, then the final."""
    wanted = [i + 1 for i in aux_ids] + [num_layers]
    ids = sorted(set(wanted))
    return ids, [ids.index(i) for i in wanted]


def text_only(model_path: str, given: Sequence[str] = ()) -> list[str]:
    """``--limit-mm-per-prompt`` with 0 of every media kind for a multimodal checkpoint
    (Kimi-K2.5), unless ``given`` (the operator's own arguments) sets it: vLLM then builds no
    vision tower (a tiny checkpoint's is not even initialised) and no multimodal processor,
    which cannot exist beside ``--skip-tokenizer-init``. [] for a text model."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    if "vision_config" not in config or any(
            a.split("=", 1)[0] == "--limit-mm-per-prompt" for a in given):
        return []
    return ["--limit-mm-per-prompt", json.dumps({m: 0 for m in MEDIA})]


def server_args(model_path: str, output_dir: str | Path, dtype: str,
                aux_layer_ids: Sequence[int] | None = None) -> list[str]:
    """The `vllm serve` arguments that turn capture on: vLLM's ``extract_hidden_states``
    method over the aux layers and the final one, and this project's connector, allowed to
    write under ``<output_dir>/states`` only. The server needs ``PYTHONPATH`` to reach the
    ``datagen`` package."""
    from datagen.extraction.estimate import default_aux_layer_ids

    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    layers = int(config.get("text_config", config)["num_hidden_layers"])
    ids, slots = vllm_capture(aux_layer_ids or default_aux_layer_ids(layers), layers)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}
    root = Path(output_dir).resolve() / STATES_DIR
    kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(root),
                                        "allow_custom_save_path": True, "dtype": dtype,
                                        "slots": slots}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching", *text_only(model_path)]


SCALED_RESIDUAL = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")  # vLLM's DeepseekV2


def engine_refusal(async_scheduling: bool, v2_runner: bool, prefix_caching: bool,
                   dtype: str, model_types: Sequence[str]) -> str | None:
    """Why a capture server must not start with these engine settings (the connector checks
    them with the engine's final config, the operator's own arguments included), or None.
    Each is a known way vLLM 0.32's states come out wrong."""
    if async_scheduling and not v2_runner:
        return ("async scheduling with the V1 model runner: accepted drafts repeat a token "
                "and the states fall out of line with the ids (vLLM #56417); drop "
                "--async-scheduling or set VLLM_USE_V2_MODEL_RUNNER=1")
    if prefix_caching:
        return ("prefix caching is on: a cached prefix has no states, so a file is shorter "
                "than its ids (vLLM #44485); pass --no-enable-prefix-caching and nothing "
                "that turns it back on")
    if dtype == "float16" and set(model_types) & set(SCALED_RESIDUAL):
        return ("float16 on a DeepSeek/Kimi model: vLLM divides its residual stream by "
                "routed_scaling_factor in float16 (aux states ~2.8x smaller than the "
                "model's); use --dtype bfloat16")
    return None


def run_aux_layer_ids(aux_layer_ids: Sequence[int] | None, model_path: str
                      ) -> list[int] | None:
    """The aux layers a run captures: the settings', else SpecForge's default for the model
    (None when neither is known here: no model_path on this host)."""
    if aux_layer_ids:
        return list(aux_layer_ids)
    config = Path(model_path or "", "config.json")
    if not model_path or not config.is_file():
        return None
    from datagen.extraction.estimate import default_aux_layer_ids

    text = json.loads(config.read_text(encoding="utf-8"))
    return list(default_aux_layer_ids(int(text.get("text_config", text)["num_hidden_layers"])))


def wait_released(path: Path, timeout_s: float) -> bool:
    """Wait until the connector released ``<path>.lock`` (the write ended, written or not);
    False after ``timeout_s``. A lock file that never appeared counts as released: the
    connector creates it before the answer leaves the server."""
    lock = Path(f"{path}.lock")
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return True
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(LOCK_POLL_S)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Header:
    tensors: dict[str, dict[str, Any]]
    data_start: int
    size: int
    metadata: dict[str, str]

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key]["shape"])


def read_header(path: Path) -> Header:
    """A safetensors header, checked against the file's size (a short file, or one that is
    not safetensors, is refused)."""
    try:
        return _read_header(path)
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        # ValueError: JSONDecodeError, UnicodeDecodeError; the rest: a header of another shape
        if isinstance(exc, CaptureMismatch):
            raise
        raise CaptureMismatch(f"{path.name}: not a safetensors file ({exc})") from exc


def _read_header(path: Path) -> Header:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CaptureMismatch(f"{path.name}: {size} bytes, no header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CaptureMismatch(f"{path.name}: header of {n} bytes in a {size}-byte file")
        meta = json.loads(fh.read(n))
    extra = meta.pop("__metadata__", None) or {}
    end = max((t["data_offsets"][1] for t in meta.values()), default=0)
    if 8 + n + end != size:
        raise CaptureMismatch(f"{path.name}: {size} bytes, the header says {8 + n + end}")
    return Header(meta, 8 + n, size, dict(extra))


def check_file(path: Path, ids: Sequence[int],
               aux_layer_ids: Sequence[int] | None = None) -> int:
    """That ``path`` holds the states of exactly ``ids`` (prompt + output minus its last):
    every key, consistent shapes, the whole size, the same ids, and (when given) the run's
    aux layers in its metadata. Returns the file's size."""
    if not path.is_file():
        failed = write_failure(path)
        raise CaptureMismatch(f"{path.name}: not written" + (f" ({failed})" if failed else ""))
    head = read_header(path)
    missing = [k for k in KEYS if k not in head.tensors]
    if missing:
        raise CaptureMismatch(f"{path.name}: no {', '.join(missing)}")
    if aux_layer_ids is not None:
        _check_layers(path, head, aux_layer_ids)
    try:
        return _check_ids(path, head, ids)
    except (struct.error, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CaptureMismatch):
            raise
        raise CaptureMismatch(f"{path.name}: unreadable ids ({exc})") from exc


def _check_layers(path: Path, head: Header, aux_layer_ids: Sequence[int]) -> None:
    try:
        stored = json.loads(head.metadata.get("aux_layer_ids", "null"))
    except ValueError:
        stored = head.metadata.get("aux_layer_ids")
    if stored != list(aux_layer_ids):
        raise CaptureMismatch(f"{path.name}: captured at aux layers {stored}, the run's are "
                              f"{list(aux_layer_ids)} (the server's launch differs)")


def _check_ids(path: Path, head: Header, ids: Sequence[int]) -> int:
    n = len(ids)
    ids_info = head.tensors["input_ids"]
    aux, final = head.shape("aux_hidden_state"), head.shape("hidden_state")
    if (ids_info["dtype"] != "I64" or ids_info["shape"] != [n] or len(aux) != 2
            or len(final) != 2 or aux[0] != n or final[0] != n or aux[1] % final[1]):
        raise CaptureMismatch(f"{path.name}: input_ids {ids_info['shape']}, aux {aux}, "
                              f"final {final}; expected {n} positions")
    start, end = ids_info["data_offsets"]
    with open(path, "rb") as fh:
        fh.seek(head.data_start + start)
        stored = struct.unpack(f"<{n}q", fh.read(end - start))
    if list(stored) != list(ids):
        first = next(i for i, (a, b) in enumerate(zip(stored, ids, strict=True)) if a != b)
        raise CaptureMismatch(f"{path.name}: token {first} is {stored[first]}, the sample's "
                              f"is {ids[first]}")
    return head.size


def attempt_rid(name: str) -> str | None:
    """The rid of a file the connector or the worker leaves under ``states/<dataset>``: the
    states (``<rid>.safetensors``), their lock (``.lock`` after it) or a write's temporary
    (``.<rid>.safetensors`` and a mark after it); None for a name of another kind."""
    stem, found, _ = name.lstrip(".").partition(SUFFIX)
    return stem if found and stem else None


def _writing(path: Path) -> bool:
    """Whether the connector holds the lock of the attempt ``path`` belongs to."""
    rid = attempt_rid(path.name)
    try:
        fd = os.open(path.parent / f"{rid}{SUFFIX}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def prune(output_dir: str | Path, dataset: str, kept: Callable[[], Container[str]]
          ) -> tuple[int, int]:
    """Delete the files of the dataset's lost attempts; returns (files, bytes) deleted.

    A lost attempt is one no counted record names and that is not in flight: reaped or timed
    out but finished on its server anyway, the losing copy of a duplicate, cut by a server
    killed mid-write. ``kept`` gives the rids to keep (``Ledger.kept``: the in-flight rids,
    then the committed ones) and is called after the folder is listed: a capture's commit
    needs its attempt's in-flight entry (commit.lua), so an attempt listed here is either
    kept then or never counted. Files whose lock the connector holds are left alone (a write
    still going on)."""
    folder = Path(output_dir).resolve() / STATES_DIR / dataset
    if not folder.is_dir():
        return 0, 0
    listed = [p for p in folder.iterdir() if attempt_rid(p.name)]
    keep = kept()
    files = size = 0
    for path in listed:
        if attempt_rid(path.name) in keep or _writing(path):
            continue
        try:
            gone = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        files, size = files + 1, size + gone
    return files, size


class Unseen:
    """Captured files in a row that this worker finds neither written nor locked. The
    connector creates a file's lock before the server answers, so such a file is one the
    server put somewhere else: once ``limit`` come in a row, the worker and the server do not
    share the states folder, and ``StatesNotShared`` says so (a file that arrives, or a lock
    that shows the server was there, starts the count over)."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def check(self, path: Path, limit: int, output_dir: str | Path) -> None:
        """Count ``path`` (just found missing); raise StatesNotShared at ``limit``."""
        seen = path.exists() or Path(f"{path}.lock").exists()
        with self._lock:
            self._count = 0 if seen else self._count + 1
            count = self._count
        if count >= limit:
            raise StatesNotShared(
                f"captured states: none of the last {count} files the server was asked for is "
                f"in {path.parent}, not even its lock (output_dir {output_dir}): the server "
                "writes its states where this worker does not see them; mount the same "
                "folder at the same output_dir on the server and every worker "
                "(capture_unseen_limit)")

    def reset(self) -> None:
        with self._lock:
            self._count = 0


def write_failure(path: Path) -> OSError | None:
    """The error the connector left in ``<path>.lock`` when its write of ``path`` failed (a
    full disk: the folder and its free space), None when it left none."""
    try:
        text = Path(f"{path}.lock").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    code, _, reason = text.removeprefix(FAILED).partition(" ")
    if not text.startswith(FAILED) or not code.isdigit():
        return None
    return OSError(int(code), reason.strip())


def built_path(path: Path) -> Path:
    """Where a file the `captured` build consumed leaves its mark (``keep_captured_states``
    off): ``<rid>.safetensors.built``, naming the training row its states went into. A record
    whose file is gone but marked still counts (merge, prepare, the ledger's rebuild keep it);
    only its states live in the training folder now."""
    return Path(f"{path}{BUILT}")


def release(path: Path, row: str) -> int:
    """Free a captured file whose training row is durable; returns the bytes freed (0: done
    before). The rename is atomic, so the file or its mark is always there: a crash never
    leaves a record that looks pruned. The mark is then cut to the row's name."""
    mark = built_path(path)
    try:
        size = path.stat().st_size
        os.replace(path, mark)
    except FileNotFoundError:
        return 0
    with open(mark, "w", encoding="utf-8") as fh:  # truncates: the space comes back here
        fh.write(row + "\n")
    Path(f"{path}.lock").unlink(missing_ok=True)
    return size


def built_row(path: Path) -> str | None:
    """The training row a consumed file went into, None when it was not consumed."""
    try:
        return built_path(path).read_text(encoding="utf-8").strip() or "?"
    except FileNotFoundError:
        return None


def only_copies(output_dir: str | Path, extracted: Path) -> list[tuple[Path, str]]:
    """(mark, row) of every captured file a build freed whose states live on only in a row
    of the extraction folder ``extracted`` (keep_captured_states off): removing that folder
    loses them for good."""
    marks = sorted((Path(output_dir) / STATES_DIR).glob(f"*/*{SUFFIX}{BUILT}"))
    rows = ((mark, mark.read_text(encoding="utf-8").strip()) for mark in marks)
    return [(mark, row) for mark, row in rows if row and (extracted / row).is_file()]


def remove(path: Path) -> None:
    """Drop an attempt's file and its lock (an abort, a failed check, a failed attempt)."""
    for p in (path, Path(f"{path}.lock")):
        p.unlink(missing_ok=True)
