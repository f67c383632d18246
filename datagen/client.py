"""HTTP client for SGLang's native API (`/generate`, `/abort_request`, `/server_info`).

One ``requests.Session`` per thread (the threads pool shares the process), both
timeouts on every call (the threads pool cannot kill a stuck task), and an
``/abort_request`` after a client-side timeout, because SGLang keeps decoding
for a client that went away.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from config.settings import masked_url
from datagen.errors import BadRequest, ServerUnavailable

log = logging.getLogger(__name__)

DATASET_HEADER = "X-Datagen-Dataset"
RETRY_STATUS = {500, 502, 503, 504}
HEALTH_CACHE_S = 1.0


RID_PREFIX_LEN = 12


def rid_prefix(dataset: str) -> str:
    """The fixed-length start of every rid of a dataset: SGLang's ``/abort_request``
    matches rids by prefix, so one call with it aborts the dataset's requests on a server
    (fixed length, so no dataset's prefix is the start of another's)."""
    return "d" + hashlib.sha1(dataset.encode("utf-8")).hexdigest()[:RID_PREFIX_LEN - 1]


def new_rid(dataset: str = "") -> str:
    """Unique rid of fixed length, starting with the dataset's prefix."""
    return rid_prefix(dataset) + uuid.uuid4().hex


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    text: str

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


class SGLangClient:
    def __init__(self, base_url: str, api_key: str | None = None,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 7200.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = (connect_timeout_s, read_timeout_s)
        self._local = threading.local()
        self._health_lock = threading.Lock()
        self._health_at = -1e9
        self._health_ok = True

    def __repr__(self) -> str:
        return f"SGLangClient({masked_url(self.base_url)})"

    @property
    def session(self) -> requests.Session:
        sess = getattr(self._local, "session", None)
        if sess is None:
            sess = requests.Session()
            if self.api_key:
                sess.headers["Authorization"] = f"Bearer {self.api_key}"
            self._local.session = sess
        return sess

    def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], rid: str,
                 dataset: str | None = None) -> Generation:
        """One /generate call; raises ServerUnavailable (retryable) or BadRequest."""
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "rid": rid, "stream": False}
        headers = {DATASET_HEADER: dataset} if dataset else {}
        started = time.monotonic()
        try:
            resp = self.session.post(f"{self.base_url}/generate", json=body, headers=headers,
                                     timeout=self.timeout)
        except requests.Timeout as exc:
            self.abort(rid)
            raise ServerUnavailable(f"/generate timed out for rid {rid}: {exc}") from exc
        except requests.RequestException as exc:
            raise ServerUnavailable(f"/generate failed: {type(exc).__name__}: {exc}") from exc
        return _parse_generation(resp, started)

    def abort(self, rid: str) -> None:
        try:
            self.session.post(f"{self.base_url}/abort_request", json={"rid": rid},
                              timeout=(self.timeout[0], 30))
        except requests.RequestException as exc:
            log.warning("abort of rid %s failed: %s", rid, exc)

    def healthy(self) -> bool:
        """``/health_generate`` (it runs one token, so a stuck server fails it), asked at
        most once per HEALTH_CACHE_S by all threads of the process together."""
        with self._health_lock:
            now = time.monotonic()
            if now - self._health_at < HEALTH_CACHE_S:
                return self._health_ok
            try:
                ok = self.session.get(f"{self.base_url}/health_generate", timeout=(2, 20)).ok
            except requests.RequestException:
                ok = False
            self._health_at, self._health_ok = time.monotonic(), ok
            return ok

    def server_info(self) -> dict[str, Any]:
        try:
            resp = self.session.get(f"{self.base_url}/server_info", timeout=(5, 30))
            resp.raise_for_status()
            return resp.json()
        except (requests.RequestException, ValueError) as exc:
            raise ServerUnavailable(
                f"cannot read {masked_url(self.base_url)}/server_info: {exc}") from exc


def _parse_generation(resp: requests.Response, started: float) -> Generation:
    if resp.status_code == 400:
        raise BadRequest(_error_message(resp))
    if resp.status_code in RETRY_STATUS or resp.status_code >= 500:
        raise ServerUnavailable(f"HTTP {resp.status_code}: {_error_message(resp)}")
    if resp.status_code != 200:
        raise BadRequest(f"HTTP {resp.status_code}: {_error_message(resp)}")
    try:
        data = resp.json()
        meta = data["meta_info"]
        output_ids = [int(x) for x in data["output_ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerUnavailable(f"malformed /generate response: {exc}") from exc
    return Generation(
        output_ids=output_ids,
        finish_reason=meta.get("finish_reason") or {},
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        latency_s=float(meta.get("e2e_latency", time.monotonic() - started)),
        text=str(data.get("text", "")),
    )


def _error_message(resp: requests.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return resp.text[:500] or resp.reason or f"HTTP {resp.status_code}"


def backoff_s(attempt: int, base_s: float, cap_s: float = 60.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0, min(cap_s, base_s * 2 ** attempt))
