"""The KV connector the `vllm` backend loads into vLLM: each request's states straight into
SpecForge's ``data_{idx}.ckpt``.

Runs inside the vLLM engine (its own virtualenv: it imports only torch, safetensors, vLLM and
datagen.extraction.files), loaded by ``kv_connector_module_path``. vLLM's
``extract_hidden_states`` method keeps, per token, the inputs of the layers listed in the
draft config's ``eagle_aux_hidden_state_layer_ids`` in a cache group of its own; vLLM's id j is
the *input* of decoder layer j, so the backend asks for the distinct ids of [a+1, b+1, c+1, N]:
the outputs of this project's aux layers a, b, c, and the last layer's pre-norm output. vLLM
keeps one state per distinct id, in layer order; ``slots`` (extra config) says which of them
goes where in the file. When a request ends, this connector takes its rows of that cache and
writes the sample as the `hf` backend does:

    input_ids        int64 [L]          the request's prompt (prompt + response of the record)
    loss_mask        int64 [L]          1 inside kv_transfer_params["loss_spans"]
    aux_hidden_state dtype [1, L, 3H]   aux layers, low | mid | high
    hidden_state     dtype [1, L, H]    the final RMSNorm over id N (weight read from the
                                        checkpoint: SpecForge stores the post-norm state)

under a temp name, fsynced and renamed (files.save_atomic), at the absolute
``hidden_states_path`` the request names, which must lie under ``shared_storage_path``. A
``<file>.lock`` (flock LOCK_EX) exists before the answer reaches the client and is released
when the write ended, written or not: the client waits on it, then checks the file.

Only tensor-parallel rank 0 writes. The copy and the write are datagen/extraction/
state_copy.py's, on plain tensors: each ended request's blocks go to the host a chunk at a
time (``copy_chunk_tokens``, default 512) through ``host_buffers`` (default 8) buffers, pinned
on CUDA, and writer threads (``num_writer_threads``) write each chunk in place. A request is
reported finished to vLLM (its blocks freed) only once all its chunks are on the host: when
the writers fall behind, ended requests keep their blocks and the scheduler waits for them
(``has_pending_block_frees``) instead of the GPU or the host taking more memory. A write that
fails (a full disk) fails that file alone: its lock holds the reason (``capture.
write_failure`` reads it: the folder and its free space) and the engine goes on.

``CaptureConnector`` (below) is the generation server's sibling for ``capture_states``: the
same rows, norm and atomic write, for generate requests that name a file under
``<output_dir>/states`` (datagen/servers/capture.py).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
)

from datagen.extraction.state_copy import StateCopier, StateLayout
from datagen.extraction.state_sink import SafetensorsSink, Sink, TorchSink, release_lock
from datagen.servers.capture import engine_refusal

log = logging.getLogger("datagen.vllm_connector")

NORM_KEYS = ("model.norm.weight", "language_model.model.norm.weight")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def final_norm_weight(model_path: str) -> torch.Tensor:
    """The final RMSNorm's weight from the checkpoint (a text model's or a multimodal one's)."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = {key: weight_map[key] for key in NORM_KEYS if key in weight_map}
    else:
        files = {key: "model.safetensors" for key in NORM_KEYS}
    for key, name in files.items():
        with safe_open(str(folder / name), framework="pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key)
    raise KeyError(f"{model_path}: none of {list(NORM_KEYS)} in the checkpoint")


def loss_mask(spans: list[list[int]], n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.int64)
    for start, end in spans:
        mask[start:end] = 1
    return mask


class DatagenConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        self._root = Path(self._storage_path).resolve()
        dtype = extra("dtype", "bfloat16")
        if dtype not in DTYPES:
            raise ValueError(f"kv_connector_extra_config dtype={dtype!r}: expected one of "
                             f"{list(DTYPES)}")
        self._dtype = DTYPES[dtype]
        self._slots = [int(i) for i in extra("slots", [])]  # aux states in file order, then final
        self._model_path = vllm_config.model_config.model
        self._eps = float(vllm_config.model_config.hf_text_config.rms_norm_eps)
        self._norm: torch.Tensor | None = None  # rank 0's worker loads it with the caches
        self._copy = (int(extra("copy_chunk_tokens", 512)), int(extra("host_buffers", 8)),
                      int(extra("assembly_bytes", 2 << 30)))
        self._copier: StateCopier | None = None  # rank 0's worker, with the caches
        self._released: set[str] = set()  # worker side: on the host, not yet reported
        self._held: set[str] = set()  # scheduler side: blocks kept until get_finished says

    # -- scheduler side ------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if request.status == RequestStatus.FINISHED_ABORTED:
            # never written: its states stop short of its ids (SpecForge reads every .ckpt);
            # its lock is released by get_finished, which sees every finished request
            self._request_filenames.pop(request.request_id, None)
            return False, None
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:  # these travel to the worker with the pending save
            sent = request.kv_transfer_params or {}
            pending.loss_spans = [list(map(int, s)) for s in sent.get("loss_spans") or []]
            pending.keep_positions = int(sent.get("keep_positions") or 0)
        if delay:
            self._held.add(request.request_id)
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        self._held.difference_update(connector_output.finished_sending or ())

    def has_pending_block_frees(self) -> bool:
        """While ended requests keep their blocks (the writers behind), a request that finds
        no free block waits for them instead of preempting a running one."""
        return bool(self._held)

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        self._norm = final_norm_weight(self._model_path).to(self._dtype)
        chunk_tokens, buffers, assembly = self._copy
        layout = StateLayout(tuple(self._slots), self._norm, self._eps, self._dtype)
        self._copier = StateCopier(self._kv_cache, layout, self._executor,
                                   chunk_blocks=max(1, chunk_tokens // self._block_size),
                                   host_buffers=buffers, assembly_bytes=assembly)

    def _inside_root(self, filename: str) -> bool:
        return Path(filename).resolve().is_relative_to(self._root)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._copier is not None
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if not self._inside_root(pending.filename):
            log.error("request %s: %s is outside %s; nothing written", pending.req_id,
                      pending.filename, self._root)
            os.close(lock_fd)
            self._released.add(pending.req_id)  # its blocks were held for nothing
            return
        n = int(pending.token_ids.shape[0])
        keep = int(getattr(pending, "keep_positions", 0) or 0)
        if keep:  # the window: the blocks past it are never copied
            n = min(n, keep)
        sink = self._sink(pending, self._copier.layout.widths(self._copier.cache.shape[-1]), n)
        self._copier.submit(pending.req_id, pending.block_ids, n, sink,
                            lambda job, error, fd=lock_fd: release_lock(fd, error))

    def _sink(self, pending: PendingSave, widths: tuple[int, int], n: int) -> Sink:
        return TorchSink(Path(pending.filename), pending.token_ids[:n].clone(),
                         loss_mask(getattr(pending, "loss_spans", []), n), widths, self._dtype)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Submit the requests that ended, copy what the host buffers allow, and report the
        requests now on the host (their blocks freed); the others keep their blocks."""
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        if self._copier is not None:
            from vllm.utils.gpu_sync_debug import gpu_sync_allowed

            with gpu_sync_allowed():
                self._released |= self._copier.pump()
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._accumulated_finished_req_ids):
            if self._copier is not None and self._copier.busy(req_id):
                continue
            self._accumulated_finished_req_ids.discard(req_id)
            if req_id in self._released:
                self._released.discard(req_id)
                done.add(req_id)
            lock_fd = self._lock_fds.pop(req_id, None)  # an aborted request's
            if lock_fd is not None:
                os.close(lock_fd)
        return done or None, None


def _refusal(vllm_config: Any) -> str | None:
    model = vllm_config.model_config
    return engine_refusal(
        bool(vllm_config.scheduler_config.async_scheduling),
        bool(getattr(vllm_config, "use_v2_model_runner", False)),
        bool(vllm_config.cache_config.enable_prefix_caching),
        str(model.dtype).removeprefix("torch."),
        [str(getattr(model.hf_config, "model_type", "")),
         str(getattr(model.hf_text_config, "model_type", ""))])


class CaptureConnector(DatagenConnector):
    """The generation server's: the states of each request that names a file, prompt and
    generated positions (``include_output_tokens``), written while the server generates.

    Differences from the extraction connector above: a request without ``hidden_states_path``
    (or naming a file outside ``shared_storage_path``) is served and nothing is locked or
    written for it (vLLM's example connector writes every request somewhere); the file is
    cut at ``keep_positions`` (the worker's train_max_length) and is
    safetensors (datagen/servers/capture.py reads its ids without torch) and has no loss mask,
    which the build step derives from the record. Both drop an aborted request's states (its
    lock released, no file)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        refusal = _refusal(vllm_config)
        if refusal:
            raise ValueError(f"capture refused: {refusal}")
        super().__init__(vllm_config, role, kv_cache_config)
        spec = vllm_config.speculative_config.draft_model_config.hf_config
        capture = list(spec.eagle_aux_hidden_state_layer_ids)
        # the project's aux layers (outputs) the file holds, for the build step to check
        self._meta = {"aux_layer_ids": json.dumps([capture[i] - 1 for i in self._slots[:-1]]),
                      "hidden_state": "post-norm"}

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for req_id, filename in list(meta.new_req_filenames.items()):
            if not self._named(req_id, scheduler_output):
                del meta.new_req_filenames[req_id]
                self._request_filenames.pop(req_id, None)
            elif not self._inside_root(filename):
                log.error("request %s: %s is outside %s; not captured", req_id, filename,
                          self._root)
                del meta.new_req_filenames[req_id]
                self._request_filenames.pop(req_id, None)
        return meta

    @staticmethod
    def _named(req_id: str, scheduler_output: Any) -> bool:
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                extra = (new.sampling_params.extra_args or {}) if new.sampling_params else {}
                return bool((extra.get("kv_transfer_params") or {}).get("hidden_states_path"))
        return False

    def _sink(self, pending: PendingSave, widths: tuple[int, int], n: int) -> Sink:
        return SafetensorsSink(Path(pending.filename), pending.token_ids[:n].clone(), widths,
                               self._dtype, self._meta)
