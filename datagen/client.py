"""HTTP client for a generation server: SGLang's native API (`/generate`, `/abort_request`,
`/server_info`), or vLLM's token-in/token-out API (`/inference/v1/generate`,
`/inference/v1/abort_requests`); the paths and bodies of each kind are in datagen/servers/,
the transport here is the same for both.

``/generate``, one call per sample, goes over one kept-alive ``http.client`` connection per
thread (a connection found closed by the server while idle is replaced before it is used);
the rarer calls go through one ``requests.Session`` per thread. requests cost 0.46-0.75 ms
of CPU per call more (``bench/bench_generate.py --phases http``, and a one-off run without
the simulator's prefill), a fifth of a worker's CPU per sample on a fast server; ~0.2 ms of
it was its lookup of proxy settings in the environment on every call (a one-off comparison
with ``trust_env`` off), the rest its adapter and urllib3's pool, retry and header objects.
Where the server's URL is not plain ``http://`` without credentials, or an environment
proxy applies to it (HTTP_PROXY and NO_PROXY, read once), ``/generate`` goes through
requests too, which speaks TLS, basic auth and proxies. Both timeouts are on every call (the
threads pool cannot kill a stuck task), and an ``/abort_request`` follows a read timeout,
because SGLang keeps decoding for a client that went away.

``server_url`` may be the SGLang router (``sglang-router``) in front of several
servers. The router proxies ``/generate`` but has no ``/abort_request`` route (it
answers 404; checked with sglang-router 0.3.2 and its source's route table) and no
``/server_info``, so for those two the client asks the servers the router lists at
``GET /workers``: an abort goes to every one of them (SGLang answers 200 for a rid it
does not run, so only the server running it acts), and the limits are the smallest of
theirs.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import random
import re
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.utils import get_environ_proxies

from config.settings import masked_url
from datagen import json_codec
from datagen.errors import BadRequest, ServerUnavailable
from datagen.servers import KINDS, SERVER_KINDS, detect
from datagen.servers.base import (
    INPUT_RESERVE,
    Generation,
    HTTPStatusError,
    Limits,
    LimitsUnknown,
    ServerKind,
)

__all__ = ["INPUT_RESERVE", "UNRESOLVED_GRACE_LEASES", "Generation", "Limits", "SGLangClient",
           "backoff_s", "new_rid", "rid_prefix"]

log = logging.getLogger(__name__)

DATASET_HEADER = "X-Datagen-Dataset"
RETRY_STATUS = {500, 502, 503, 504}
HEALTH_CACHE_S = 1.0
# How long the servers a router lists are reused for aborts (a close or a shutdown aborts
# each of its requests; the router's set of servers changes rarely).
BACKENDS_CACHE_S = 10.0
# A failed name lookup of the server's host is no verdict for this share of a lease
# (lease_s): a container network's DNS answers EAI_AGAIN, and EAI_NONAME for seconds, about a
# host that is up (Podman's: 4.6 s in a fresh-clone CI). Past it, the name is taken for gone
# (a removed container or pod) and the host for lost, as a silent cut is: the leases end and
# the requests run elsewhere, half a lease later than a cut's.
UNRESOLVED_GRACE_LEASES = 0.5
# A data-parallel router lists each rank as "<url>@<rank>"; the server is "<url>".
_DP_RANK = re.compile(r"@\d+$")


RID_PREFIX_LEN = 12


def rid_prefix(dataset: str) -> str:
    """The fixed-length start of every rid of a dataset, so a server's log tells the
    dataset of each request (the router drops the dataset header). Not for aborts:
    SGLang 0.5.23 matches an ``/abort_request`` rid exactly (a prefix aborts nothing)."""
    return "d" + hashlib.sha1(dataset.encode("utf-8")).hexdigest()[:RID_PREFIX_LEN - 1]


def new_rid(dataset: str = "") -> str:
    """Unique rid of fixed length, starting with the dataset's prefix."""
    return rid_prefix(dataset) + uuid.uuid4().hex


class SGLangClient:
    def __init__(self, base_url: str, api_key: str | None = None,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 7200.0,
                 kind: str = "sglang", unresolved_grace_s: float = 0.0):
        if kind not in SERVER_KINDS:
            raise ValueError(f"server kind {kind!r} is not one of {SERVER_KINDS}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self._kind: ServerKind | None = KINDS.get(kind)  # None: "auto", read on first use
        self._kind_lock = threading.Lock()
        self.timeout = (connect_timeout_s, read_timeout_s)
        self._local = threading.local()
        self._health_lock = threading.Lock()
        self._health_at = -1e9
        self._health_ok = True
        self._backends: tuple[float, list[str]] = (-1e9, [])
        self._backends_lock = threading.Lock()
        self._direct = _Connections.for_url(self.base_url, connect_timeout_s, read_timeout_s)
        self._unresolved = _Unresolved(unresolved_grace_s)
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def __repr__(self) -> str:
        kind = self._kind.name if self._kind else "auto"
        return f"SGLangClient({masked_url(self.base_url)}, {kind})"

    @property
    def kind(self) -> ServerKind:
        """The server's kind; with ``"auto"`` read from it once (raises ServerUnavailable
        while it does not answer)."""
        if self._kind is None:
            with self._kind_lock:
                if self._kind is None:
                    try:
                        self._kind = detect(lambda path: self._get_json(self.base_url, path))
                    except OSError as exc:
                        raise ServerUnavailable(f"cannot tell the kind of the server at "
                                                f"{masked_url(self.base_url)}: {exc}") from exc
                    log.info("%s is a %s server", masked_url(self.base_url), self._kind.name)
        return self._kind

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
                 dataset: str | None = None, extra: Mapping[str, Any] | None = None,
                 logprobs: bool = False, prompt_logprobs: bool = False) -> Generation:
        """One generate call; raises ServerUnavailable (retryable) or BadRequest. ``extra``
        goes into the body as it is (vLLM's ``kv_transfer_params`` with capture_states);
        ``logprobs`` / ``prompt_logprobs``: the sampled tokens' / the prompt ids'
        log-probabilities where the kind gives them."""
        kind = self.kind
        path = kind.generate_path
        body = kind.generate_body(input_ids, sampling_params, rid, logprobs, prompt_logprobs)
        body.update(extra or {})
        headers = dict(self._headers, **{DATASET_HEADER: dataset}) if dataset else self._headers
        started = time.monotonic()
        try:
            if self._direct is None:  # TLS, credentials in the URL or a proxy: requests
                resp = self.session.post(f"{self.base_url}{path}", json=body,
                                         headers=headers, timeout=self.timeout)
                status, content, reason = resp.status_code, resp.content, resp.reason or ""
            else:
                conn = self._direct.connection()
                with self._direct.in_flight(conn):
                    status, content, reason = _post(conn, self._direct.path + path,
                                                    _body_bytes(body), headers)
        except (TimeoutError, requests.Timeout) as exc:
            self.abort(rid)
            raise ServerUnavailable(f"{path} timed out for rid {rid}: {exc}") from exc
        except (OSError, http.client.HTTPException) as exc:  # requests' errors are OSErrors
            raise ServerUnavailable(f"{path} failed: {type(exc).__name__}: {exc}") from exc
        return _parse_generation(kind, status, content, reason, started)

    def drop_in_flight(self) -> int:
        """Abort this process's /generate connections that wait for an answer (the server
        cannot be reached from here): their threads get ServerUnavailable at once instead of
        waiting up to ``read_timeout_s``, and what the kernel had not yet delivered is
        discarded, so a request still on its way cannot reach the server after the network
        heals and run there again. Returns how many."""
        return self._direct.drop_in_flight() if self._direct is not None else 0

    def abort(self, rid: str) -> None:
        """Abort exactly ``rid`` (SGLang 0.5.23 drops a rid it does not run, answering 200:
        a prefix aborts nothing; vLLM answers 200 too); behind a router that has no such
        route, on every server the router lists."""
        try:
            kind = self.kind
        except ServerUnavailable as exc:
            log.warning("abort of rid %s: %s", rid, exc)
            return
        status = self._post_abort(self.base_url, kind, rid)
        if status != 404:
            return
        backends = self.backends()
        if not backends:
            log.warning("abort of rid %s: %s has no %s and lists no servers at /workers",
                        rid, masked_url(self.base_url), kind.abort_path)
        for url in backends:
            self._post_abort(url, kind, rid)

    def _post_abort(self, url: str, kind: ServerKind, rid: str) -> int | None:
        try:
            resp = self.session.post(f"{url}{kind.abort_path}", json=kind.abort_body(rid),
                                     timeout=(self.timeout[0], 30))
        except requests.RequestException as exc:
            log.warning("abort of rid %s at %s failed: %s", rid, masked_url(url), exc)
            return None
        if not resp.ok and resp.status_code != 404:
            log.warning("abort of rid %s at %s: HTTP %d", rid, masked_url(url),
                        resp.status_code)
        return resp.status_code

    def backends(self) -> list[str]:
        """The servers behind ``base_url`` when it is an SGLang router, else []:
        ``GET /workers`` (``{"workers": [{"url": ...}]}``), or ``GET /list_workers``
        (``{"urls": [...]}``) of older routers; reused for BACKENDS_CACHE_S."""
        with self._backends_lock:  # a close's aborts ask from many threads at once
            fetched_at, urls = self._backends
            if time.monotonic() - fetched_at < BACKENDS_CACHE_S:
                return urls
            urls = self._list_backends()
            self._backends = (time.monotonic(), urls)
        if urls:
            log.info("%s is a router: aborts and the context length go to its %d servers",
                     masked_url(self.base_url), len(urls))
        return urls

    def _list_backends(self) -> list[str]:
        for path, read in (("/workers", _worker_urls), ("/list_workers", _listed_urls)):
            try:
                resp = self.session.get(f"{self.base_url}{path}", timeout=(5, 30))
                if resp.ok:
                    urls = read(resp.json())
                    if urls:
                        return sorted({_DP_RANK.sub("", u).rstrip("/") for u in urls})
            except (requests.RequestException, ValueError, TypeError, AttributeError):
                continue
        return []

    def healthy(self) -> bool:
        """The kind's health path (SGLang's ``/health_generate`` runs one token, so a stuck
        server fails it; vLLM's ``/health`` asks its engine core), asked at most once per
        HEALTH_CACHE_S by all threads of the process together."""
        with self._health_lock:
            now = time.monotonic()
            if now - self._health_at < HEALTH_CACHE_S:
                return self._health_ok
            try:
                path = self.kind.health_path
                ok = self.session.get(f"{self.base_url}{path}", timeout=(2, 20)).ok
            except (requests.RequestException, ServerUnavailable):
                ok = False
            self._health_at, self._health_ok = time.monotonic(), ok
            return ok

    def reachable(self, timeout_s: float = 3.0) -> bool:
        """False only when the server's host cannot be reached at all: a new TCP connection
        to it timed out or found no route (a silent network cut, a host gone). A refused
        connection (the host is up, the server down: every worker sees that and waits for
        it) counts as reachable, and so does a slow server: nothing is asked of it but the
        connection (SGLang's /health waits on its scheduler, seconds on a loaded CPU). A
        name that does not resolve is no verdict for ``unresolved_grace_s`` from the first
        failed lookup of a run of them (``_Unresolved``), then a host gone."""
        parts = urlsplit(self.base_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
        except ConnectionRefusedError:
            self._unresolved.resolved()
            return True
        except socket.gaierror as exc:
            return self._unresolved.within_grace(exc)
        except OSError:  # timed out, no route to the host
            self._unresolved.resolved()
            return False
        self._unresolved.resolved()
        return True

    def limits(self) -> Limits:
        """The context length and longest input the server accepts (``ServerKind.limits``);
        behind a router, the smallest of its servers' (so every prompt the producer sizes
        fits on each one)."""
        try:
            return self._limits_at(self.base_url)
        except LimitsUnknown as exc:
            unknown = exc
        behind = [x for x in map(self._known_limits, self.backends()) if x]
        if behind:
            return Limits(min(x.context_length for x in behind),
                          min(x.max_input_tokens for x in behind),
                          "the smallest of " + ", ".join(x.source for x in behind))
        raise ServerUnavailable(str(unknown)) from unknown

    def _limits_at(self, url: str) -> Limits:
        return self.kind.limits(lambda path: self._get_json(url, path), masked_url(url))

    def _known_limits(self, url: str) -> Limits | None:
        try:
            return self._limits_at(url)
        except LimitsUnknown:
            return None

    def _get_json(self, url: str, path: str) -> Any:
        """GET ``url + path``'s JSON; OSError when nothing answers, HTTPStatusError for an
        HTTP error, ValueError for a body that is not JSON."""
        resp = self.session.get(f"{url}{path}", timeout=(5, 30))
        if not resp.ok:
            raise HTTPStatusError(resp.status_code,
                                  f"HTTP {resp.status_code} from {masked_url(url)}{path}")
        return resp.json()  # requests' JSONDecodeError is a ValueError


class _Unresolved:
    """How long the server's name has failed to resolve, for ``reachable``: no verdict for
    ``grace_s`` from the first failure of a run of them (UNRESOLVED_GRACE_LEASES says why).
    Taken for a cut at once, the leases of requests going on over their connections would
    end and they would run twice (12 samples stored twice in a fresh-clone CI, where
    Podman's DNS did not know a live "sglang" for 4.6 s); never, a removed container's or
    pod's name would stall the run on it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self._since: float | None = None  # monotonic time of the run's first failure
        self._told = False  # the run past its grace was logged
        self._lock = threading.Lock()

    def within_grace(self, exc: socket.gaierror) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._since is None:
                self._since = now
            failing_s = now - self._since
            if failing_s < self.grace_s:
                return True
            told, self._told = self._told, True
        if not told:
            log.warning("the server's name has not resolved for %.1fs (%s): its host is "
                        "taken for gone", failing_s, exc)
        return False

    def resolved(self) -> None:
        with self._lock:
            self._since, self._told = None, False


def _worker_urls(data: Any) -> list[str]:
    return [str(w["url"]) for w in data.get("workers", []) if w.get("url")]


def _listed_urls(data: Any) -> list[str]:
    return [str(u) for u in data.get("urls", [])]


class _Connections:
    """One kept-alive connection per thread to a plain-HTTP server, for /generate."""

    def __init__(self, host: str, port: int, path: str, connect_timeout_s: float,
                 read_timeout_s: float):
        self.host, self.port, self.path = host, port, path
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self._local = threading.local()
        self._busy: set[http.client.HTTPConnection] = set()  # waiting for an answer
        self._busy_lock = threading.Lock()

    @classmethod
    def for_url(cls, url: str, connect_timeout_s: float, read_timeout_s: float
                ) -> _Connections | None:
        """None where requests must carry the call: TLS, credentials, a proxy."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.username or get_environ_proxies(url):
            return None
        return cls(parts.hostname or "localhost", parts.port or 80, parts.path.rstrip("/"),
                   connect_timeout_s, read_timeout_s)

    def connection(self) -> http.client.HTTPConnection:
        """This thread's connection, connected; raises ServerUnavailable when it cannot."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port,
                                              timeout=self.connect_timeout_s)
            self._local.conn = conn
        elif conn.sock is not None and _readable(conn.sock):
            conn.close()  # idle, so readable means closed by the server (or garbage)
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:
                conn.close()
                raise ServerUnavailable(f"/generate failed: cannot connect to "
                                        f"{self.host}:{self.port}: {exc}") from exc
            conn.sock.settimeout(self.read_timeout_s)
            # Headers and body go out as two sends: without this the body would wait for
            # the headers' ACK (Nagle against delayed ACKs). urllib3 and aiohttp set it too.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


    @contextmanager
    def in_flight(self, conn: http.client.HTTPConnection) -> Iterator[None]:
        with self._busy_lock:
            self._busy.add(conn)
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy.discard(conn)

    def drop_in_flight(self) -> int:
        """Reset every busy connection: linger 0, then a shutdown of its reading side, which
        wakes the thread blocked on the answer and sends nothing; that thread closes the
        connection itself (closing another thread's socket is unsafe), and with linger 0
        the close throws away unsent bytes and sends RST, not FIN."""
        with self._busy_lock:
            busy = list(self._busy)
        dropped = 0
        for conn in busy:
            sock = conn.sock
            if sock is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RD)
                dropped += 1
            except OSError:
                pass  # closed meanwhile: its thread has its answer or its error already
        return dropped


def _readable(sock: Any) -> bool:
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _post(conn: http.client.HTTPConnection, path: str, body: bytes,
          headers: dict[str, str]) -> tuple[int, bytes, str]:
    """One request and its whole answer; a connection left mid-answer is closed."""
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        content = resp.read()
    except BaseException:
        conn.close()
        raise
    if resp.will_close:
        conn.close()
    return resp.status, content, resp.reason or ""


def _body_bytes(body: Mapping[str, Any]) -> bytes:
    try:
        return json_codec.dumps(body)
    except UnicodeEncodeError:  # a lone surrogate (a stop string?): \u-escaped, as always
        return json.dumps(body).encode()


def _parse_generation(kind: ServerKind, status: int, content: bytes, reason: str,
                      started: float) -> Generation:
    if status == 400:
        raise BadRequest(_error_message(status, content, reason))
    if status in RETRY_STATUS or status >= 500:
        raise ServerUnavailable(f"HTTP {status}: {_error_message(status, content, reason)}")
    if status != 200:
        raise BadRequest(f"HTTP {status}: {_error_message(status, content, reason)}")
    try:
        return kind.parse_generation(json_codec.loads(content), time.monotonic() - started)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerUnavailable(f"malformed {kind.generate_path} response: {exc!r}") from exc


def _error_message(status: int, content: bytes, reason: str) -> str:
    try:
        err = json.loads(content).get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return content[:500].decode("utf-8", "replace") or reason or f"HTTP {status}"


def backoff_s(attempt: int, base_s: float, cap_s: float = 60.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0, min(cap_s, base_s * 2 ** attempt))
