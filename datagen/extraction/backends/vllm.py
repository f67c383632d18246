"""The `vllm` backend: a vLLM engine over the replica's devices writes each sample's file itself.

The path for INT4 Kimi-K2.5 on a node: vLLM runs its compressed-tensors weights with tensor
parallelism over the node's GPUs (``tensor_parallel_size`` = the replica's device count) and
captures the aux layers inside its forward (the ``extract_hidden_states`` speculative method).
This project's connector (datagen/extraction/vllm_connector.py, loaded into the engine by
``kv_connector_module_path``) writes each finished request straight into SpecForge's
``data_{idx}.ckpt``; nothing comes back to this process but the answer, and the Extractor only
waits for the file and records it (manifest, counts), as for the other backends.

The engine is vLLM's OpenAI-compatible server, started by this process from the Python of an
environment that has vLLM (``vllm_python``; vLLM pins its own torch and transformers) under a
small launcher: the server, its engine core and its workers share one process group that the
launcher kills when this process dies (``PR_SET_PDEATHSIG``; a SIGKILLed API server leaves its
engine core and workers running otherwise, measured), or when the backend closes. Each sample
is one prefill-only request (``max_tokens`` 1) of its exact token ids; up to
``vllm_inflight`` are in flight so the engine batches them.

    POST /v1/completions {"prompt": [ids], "max_tokens": 1,
                          "kv_transfer_params": {"hidden_states_path": <abs file>,
                                                 "loss_spans": [[start, end], ...]}}

The answer comes before the file is written: ``<file>.lock`` is held (flock) until the write
ended, so the client waits on it, then checks that the file is there. An engine that stopped
(connection refused, 5xx, a lock released with no file) ends the shard with ``EngineLost``:
its written samples stay done and the shard is retried with a new engine. A write the
connector could not finish (a full disk) is not the engine's: its lock names the error (the
folder and its free space), raised as that OSError, and the shard fails as a storage error
with the engine kept.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datagen.errors import EngineLost
from datagen.extraction.backends.base import set_shape, text_config
from datagen.servers.capture import text_only, vllm_capture, write_failure
from datagen.servers.launch import LAUNCHER, engine_env, free_port, stop_group

log = logging.getLogger(__name__)

SERVED_NAME = "datagen-target"
CONNECTOR = "DatagenConnector"
CONNECTOR_MODULE = "datagen.extraction.vllm_connector"
LOCK_POLL_S = 0.02


@dataclass(frozen=True)
class EngineOptions:
    python: str = ""              # "": this interpreter, when it can import vllm
    args: str = ""                # more `vllm serve` arguments, shell-quoted
    inflight: int = 64            # requests in flight
    start_timeout_s: float = 1800.0
    tensor_parallel: int = 1
    log_path: str = ""            # "": <output_dir>/logs/vllm-<host>-<pid>.log


def engine_python(wanted: str) -> str:
    if wanted:
        if not Path(wanted).is_file():
            raise ValueError(f"vllm_python={wanted!r}: no such file (the Python of an "
                             "environment with vLLM: `make vllm-env` makes .venv-vllm)")
        return wanted
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("extract_backend='vllm' needs vLLM: set vllm_python to the Python of "
                         "an environment that has it (`make vllm-env` makes "
                         ".venv-vllm/bin/python), or install vllm here")
    return sys.executable


class VLLMServer:
    """vLLM's OpenAI-compatible server in a process group of its own, ready on return."""

    def __init__(self, cfg: Any, opts: EngineOptions, aux_ids: Sequence[int], num_layers: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = Path(cfg.output_dir).resolve()
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = Path(opts.log_path or out / "logs" /
                             f"vllm-{socket.gethostname()}-{os.getpid()}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        capture, slots = vllm_capture(aux_ids, num_layers)
        spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": capture}}}
        kv = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
              "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(out),
                                            "allow_custom_save_path": True,
                                            "dtype": cfg.dtype, "slots": slots}}
        python = engine_python(opts.python)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model_path,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", cfg.dtype,
               "--max-model-len", str(cfg.max_length + 1),  # + the one token it generates
               "--tensor-parallel-size", str(opts.tensor_parallel),
               "--skip-tokenizer-init", "--no-enable-prefix-caching",
               "--speculative-config", json.dumps(spec),
               "--kv-transfer-config", json.dumps(kv), *shlex.split(opts.args)]
        if cfg.trust_remote_code:
            cmd.append("--trust-remote-code")
        cmd += text_only(cfg.model_path, shlex.split(opts.args))
        env = engine_env()
        log.info("starting vLLM (%s, TP %d) for %s; log: %s", python, opts.tensor_parallel,
                 cfg.model_path, self.log_path)
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen(
                [python, "-c", LAUNCHER, str(os.getpid()), *cmd], stdout=fh,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(opts.start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_ready(self, timeout_s: float) -> None:
        import requests

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise EngineLost(f"vLLM exited with {self.proc.returncode} while starting: "
                                 f"{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    log.info("vLLM ready on %s after %.0fs", self.url, time.monotonic() - t0)
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise EngineLost(f"vLLM not ready after {timeout_s:.0f}s (vllm_start_timeout_s); "
                         f"log: {self.log_path}")

    def log_tail(self) -> str:
        """The first error vLLM logged (its workers' root cause comes before the API server's
        own traceback), else the log's last lines."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        errors = [line for line in text if " WARNING " not in line
                  and re.search(r"\b\w+(Error|Exception): ", line)]
        return (errors[0] if errors else "\n".join(text[-15:])) + f" (log: {self.log_path})"

    def stop(self) -> None:
        stop_group(self.proc)


def loss_spans(mask: Sequence[int]) -> list[list[int]]:
    """[start, end) runs of 1 in a loss mask."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append([start, i])
            start = None
    return spans


class VLLMBackend:
    packs = False
    writes_files = True  # the engine writes each sample's file; forward_row is never called

    def __init__(self, cfg: Any, device: torch.device, opts: EngineOptions):
        set_shape(self, text_config(cfg.model_path), cfg.aux_layer_ids, device)
        self.inflight = opts.inflight
        self.read_timeout_s = max(600.0, opts.start_timeout_s)
        self.server = VLLMServer(cfg, opts, self.aux_layer_ids, self.num_layers)
        self._local = threading.local()

    def forward_row(self, id_lists: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        raise NotImplementedError("the vllm backend writes files: Extractor uses extract()")

    def _session(self) -> Any:
        import requests

        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def extract(self, sample: Any, mask: Sequence[int], path: Path,
                check: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> int:
        """One sample (files.Sample) through the engine into ``path``; returns the file's
        size. ``check`` (the state check) sees the file's aux [n, 3H] and final states
        [n, H] once written; a sample it refuses leaves no file."""
        import requests

        ids = sample.input_ids
        path = path.resolve()
        path.unlink(missing_ok=True)  # an older file of this sample, never recorded: rewritten
        body = {"model": SERVED_NAME, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"hidden_states_path": str(path),
                                       "loss_spans": loss_spans(mask)}}
        try:
            resp = self._session().post(self.server.url + "/v1/completions", json=body,
                                        timeout=(5, self.read_timeout_s))
        except requests.RequestException as exc:
            raise self._lost(f"{type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise self._lost(f"HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:  # the engine refused this sample (too long, bad ids)
            raise ValueError(f"vLLM answered {resp.status_code}: {resp.text[:300]}")
        failed = self._wait_written(path)
        if not path.is_file():
            if failed is not None:  # the connector's disk, not the engine: the engine stays
                raise failed
            raise self._lost(f"vLLM answered but wrote no {path.name}")
        if check is not None:
            try:
                written = torch.load(path, weights_only=True, mmap=True)
                check(written["aux_hidden_state"][0], written["hidden_state"][0])
            except BaseException:
                path.unlink(missing_ok=True)
                raise
        return path.stat().st_size

    def _wait_written(self, path: Path) -> OSError | None:
        """Until the connector released the file's lock, or its engine stopped; EngineLost
        when it holds the lock past ``read_timeout_s`` (a writer that never ends). The
        error the connector left in the lock when its write failed (a full disk), if any."""
        lock = Path(f"{path}.lock")
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            return None  # nothing was ever locked: the caller finds no file
        deadline = time.monotonic() + self.read_timeout_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not self.server.alive():
                        break
                    if time.monotonic() > deadline:
                        raise self._lost(f"{path.name} still being written after "
                                         f"{self.read_timeout_s:.0f} s") from None
                    time.sleep(LOCK_POLL_S)
        finally:
            os.close(fd)
        failed = write_failure(path)
        lock.unlink(missing_ok=True)
        return failed

    def _lost(self, why: str) -> EngineLost:
        state = "running" if self.server.alive() else f"exited ({self.server.proc.returncode})"
        return EngineLost(f"vLLM engine {state}: {why}; log: {self.server.log_path}")

    def close(self) -> None:
        self.server.stop()


def create(cfg: Any, device: torch.device) -> VLLMBackend:
    return VLLMBackend(cfg, device, cfg.engine)
