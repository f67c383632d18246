"""The Mooncake data plane a stream runs on: ``mooncake_master`` (with its HTTP metadata
server) and a standalone segment holder (``mooncake_client``), on loopback, free ports.

Stored bytes live in the segment of whoever mounted it and vanish with it, so
the bytes are held by a process of their own, not by the producer: a gpu worker that dies
leaves what it put readable until the consumer frees it. Both processes run in their own
session (process group), and the plane writes ``<stream_dir>/plane.json`` (:class:`PlaneInfo`)
for the publishers and the consumer's command to read.

Layout of a stream folder::

    plane.json               addresses, store id, holder pid, channel path, consumer state dir
    mooncake/*.log           the master's and the holder's logs
    consumer/refs.jsonl      SpecForge's StreamingRefChannel (and its sidecars)
    consumer/state/          the consumer's state (consumer.sqlite)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from datagen.errors import BadInput
from datagen.generation.records import atomic_file
from datagen.servers.launch import free_port

PLANE_NAME = "plane.json"
PROTOCOL = "tcp"
SEGMENT_BYTES = 1 << 30          # the holder's segment: the most the store holds at once
PRODUCER_BUFFER_BYTES = 64 << 20  # a publisher's local staging buffer (it mounts no segment)


@dataclass(frozen=True)
class PlaneInfo:
    """Where a running plane answers, and the consumer it feeds (``plane.json``)."""

    master_addr: str     # host:port of the master's RPC
    metadata_url: str    # the master's HTTP metadata server
    metrics_url: str     # the master's admin server (/metrics: key count, capacity)
    protocol: str
    store_id: str        # the consumer's DISAGG_STORE_ID: every key is under it
    holder_pid: int
    holder_port: int
    segment_bytes: int
    channel_path: str    # the consumer's refs.jsonl
    state_dir: str       # the consumer's state folder (consumer.sqlite)
    epochs: int = 1      # the consumer's horizon in epochs: the last one closes the channel

    @property
    def dir(self) -> Path:
        """The stream folder (plane.json, published.jsonl): the channel's folder's parent."""
        return Path(self.channel_path).parent.parent

    @property
    def db_path(self) -> Path:
        return Path(self.state_dir) / "consumer.sqlite"

    def env(self) -> dict[str, str]:
        """What SpecForge's disaggregated roles read from the environment."""
        return {"MOONCAKE_METADATA_SERVER": self.metadata_url,
                "MOONCAKE_MASTER_SERVER_ADDR": self.master_addr,
                "MOONCAKE_PROTOCOL": self.protocol,
                "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
                "DISAGG_STORE_ID": self.store_id,
                "DISAGG_REF_CHANNEL": self.channel_path,
                # the consumer only reads; the holder's segment keeps the bytes
                "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
                "MOONCAKE_LOCAL_BUFFER_SIZE": str(PRODUCER_BUFFER_BYTES)}

    def setup_kwargs(self) -> dict[str, object]:
        """MooncakeDistributedStore.setup() for a publisher: no segment of its own."""
        return {"local_hostname": "127.0.0.1", "metadata_server": self.metadata_url,
                "master_server_addr": self.master_addr, "protocol": self.protocol,
                "global_segment_size": 0, "local_buffer_size": PRODUCER_BUFFER_BYTES}

    def write(self, stream_dir: Path) -> Path:
        path = Path(stream_dir) / PLANE_NAME
        with atomic_file(path) as fh:
            fh.write(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, stream_dir: str | Path) -> PlaneInfo:
        path = Path(stream_dir) / PLANE_NAME
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            return cls(**body)
        except FileNotFoundError:
            raise BadInput(f"{path} is missing: no plane was started in {stream_dir} "
                           "(`datagen stream` starts one)") from None
        except (ValueError, TypeError) as exc:
            raise BadInput(f"{path} is not a plane description: {exc}") from exc


def metrics(metrics_url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """The master's gauges (``master_key_count``, ``master_total_capacity_bytes``, ...)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if name and "{" not in name:
                out[name] = float(value)
    return out


def key_count(info: PlaneInfo) -> int:
    """How many objects the store holds now (one per tensor of each resident sample)."""
    return int(metrics(info.metrics_url)["master_key_count"])


def mooncake_binary(name: str) -> str:
    """``mooncake_master``/``mooncake_client`` from this interpreter's venv, else the PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise BadInput(f"{name} not found beside {sys.executable} nor on the PATH: install "
                       "the 'stream' extra (mooncake-transfer-engine-non-cuda)")
    return found


class Plane:
    """``with Plane(stream_dir) as info: ...`` — master and holder started, stopped on exit."""

    def __init__(self, stream_dir: str | Path, segment_bytes: int = SEGMENT_BYTES,
                 store_id: str | None = None, epochs: int = 1):
        self.dir = Path(stream_dir).resolve()
        self.segment_bytes = segment_bytes
        self.epochs = epochs
        self.store_id = store_id or f"datagen-{uuid.uuid4().hex[:8]}"
        self.master: subprocess.Popen[bytes] | None = None
        self.holder: subprocess.Popen[bytes] | None = None
        self.info: PlaneInfo | None = None
        self._ports: dict[str, int] = {}

    def start(self, timeout_s: float = 120.0) -> PlaneInfo:
        # timeout_s bounds a hung start only: each wait fails at once when its process exits.
        (self.dir / "mooncake").mkdir(parents=True, exist_ok=True)
        (self.dir / "consumer" / "state").mkdir(parents=True, exist_ok=True)
        self._ports = {k: free_port() for k in ("rpc", "metadata", "metrics", "holder")}
        self.master = self._spawn("master", [
            mooncake_binary("mooncake_master"), f"--rpc_port={self._ports['rpc']}",
            "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self._ports['metadata']}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self._ports['metrics']}"])
        self.info = self._info(holder_pid=0)
        self._wait(self.master, "master", timeout_s, self._master_answers)
        self.start_holder(timeout_s)
        return self.info

    def start_holder(self, timeout_s: float = 120.0) -> PlaneInfo:
        """(Re)start the segment holder; plane.json then names its pid."""
        assert self.info is not None, "start() the plane first"
        capacity = self._capacity()
        self.holder = self._spawn("holder", [
            mooncake_binary("mooncake_client"), "--host=127.0.0.1",
            f"--port={self._ports['holder']}", f"--master_server_address={self.info.master_addr}",
            f"--metadata_server={self.info.metadata_url}", f"--protocol={PROTOCOL}",
            f"--global_segment_size={self.segment_bytes}"])
        self._wait(self.holder, "holder", timeout_s,
                   lambda: self._capacity() >= capacity + self.segment_bytes)
        self.info = self._info(holder_pid=self.holder.pid)
        self.info.write(self.dir)
        return self.info

    def _info(self, holder_pid: int) -> PlaneInfo:
        consumer = self.dir / "consumer"
        return PlaneInfo(master_addr=f"127.0.0.1:{self._ports['rpc']}",
                         metadata_url=f"http://127.0.0.1:{self._ports['metadata']}/metadata",
                         metrics_url=f"http://127.0.0.1:{self._ports['metrics']}/metrics",
                         protocol=PROTOCOL, store_id=self.store_id, holder_pid=holder_pid,
                         holder_port=self._ports["holder"], segment_bytes=self.segment_bytes,
                         channel_path=str(consumer / "refs.jsonl"),
                         state_dir=str(consumer / "state"), epochs=self.epochs)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / "mooncake" / f"{name}.log", "ab")  # noqa: SIM115 (the child's)
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=self.dir / "mooncake")
        finally:
            log.close()

    def _master_answers(self) -> bool:
        assert self.info is not None
        try:
            metrics(self.info.metrics_url, timeout_s=0.5)
            urllib.request.urlopen(f"{self.info.metadata_url}?key=ready", timeout=0.5)
        except urllib.error.HTTPError:
            return True  # 404 for an unknown key: the metadata server answers
        except (OSError, ValueError):
            return False
        return True

    def _capacity(self) -> int:
        assert self.info is not None
        try:
            return int(metrics(self.info.metrics_url, timeout_s=0.5)
                       ["master_total_capacity_bytes"])
        except (OSError, ValueError, KeyError):
            return -1

    def _wait(self, proc: subprocess.Popen[bytes], name: str, timeout_s: float,
              ready: object) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake {name} exited with {proc.returncode}; see "
                                   f"{self.dir / 'mooncake' / f'{name}.log'}")
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake {name} did not answer in {timeout_s:.0f}s; see "
                           f"{self.dir / 'mooncake' / f'{name}.log'}")

    def kill_holder(self) -> None:
        """SIGKILL the segment holder (a fault: everything it held is gone)."""
        _stop(self.holder, kill=True)
        self.holder = None

    def restart_holder(self, timeout_s: float = 120.0) -> PlaneInfo:
        """A new holder after the old one died. The master keeps a dead holder's segment (and
        sends puts to it, which fail) until its heartbeat ttl (mooncake_master --client_ttl,
        10 s) unmounts it: the new holder starts once the master has let the old one go."""
        self.kill_holder()
        assert self.master is not None
        self._wait(self.master, "master", timeout_s, lambda: self._capacity() == 0)
        return self.start_holder(timeout_s)

    def stop(self) -> None:
        _stop(self.holder)
        _stop(self.master)
        self.holder = self.master = None

    def __enter__(self) -> PlaneInfo:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop(proc: subprocess.Popen[bytes] | None, kill: bool = False) -> None:
    """End a process group we started: SIGTERM (or SIGKILL), then SIGKILL after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
