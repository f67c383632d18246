"""A model replica over N ranks: ``datagen worker gpu --gpus 0-7`` (or ``--gpus cpu:2``).

    launcher (this process)      starts N rank processes, torchrun-style environment
      rank 0   Celery consumer of the `gpu` queue (solo pool) + Extractor + its backend part
      rank k   its backend part only: runs every row rank 0 announces, stores nothing

Before each row rank 0 broadcasts the row's token ids to the other ranks (gloo, a command
group of its own); then every rank runs the forward pass of its part of the model (the
backend's own group: gloo on CPU, nccl on CUDA), and rank 0 alone stages, writes the files,
the manifest and the ledger entries (it takes messages without acks: datagen/broker.py).
Per row rather than per shard: rank 0 keeps all the reading, batching and writing, the other
ranks stay a loop of five lines.

Faults: the launcher watches its ranks; the first one to exit (SIGKILL, OOM, a failed load)
makes it SIGKILL the others and exit non-zero, for a supervisor to restart the replica. A
forward that raises on rank 0 exits it at once (``os._exit``: the lease must not be released
as after an ordinary failure). Nothing is lost or counted twice: files are renamed into place
complete, the shard's lease expires and any live gpu worker's reaper re-enqueues it ahead of
fresh shards; the samples already in the manifest are not redone. A rank that hangs is found
by the backend group's timeout (``replica_timeout_s``) on the ranks waiting for it, and rank
0's announcement of a row waits no longer than that either: the command group's own timeout
is for the other ranks, idle between rows for as long as the queue is empty (a gloo
broadcast's root waits for each receiver to post its receive, so a stopped rank held rank 0
there, and with it the shard's lease, for ever).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from config.settings import Settings
from datagen.extraction.backends import DISTRIBUTED, ENGINE
from datagen.extraction.devices import Devices, parse_gpus
from datagen.redis_server import free_port

log = logging.getLogger(__name__)

EXIT_REPLICA_BROKEN = 75  # a forward failed on rank 0: the replica cannot go on
STOP = "stop"
IDLE_TIMEOUT = timedelta(days=30)  # the other ranks wait this long for rank 0's next row
CALIBRATE_ENV = "DATAGEN_REPLICA_CALIBRATE"  # "seq_len,batches": rank 0 measures, then stops


def visible_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_start(settings: Settings, devices: Devices, visible: int | None = None) -> None:
    """Refuse to start, with one line, what could only fail after taking a shard."""
    backend = settings.extract_backend
    if devices.ranks > 1 and backend not in (*DISTRIBUTED, ENGINE):
        raise ValueError(f"gpus={settings.gpus!r} asks for {devices.ranks} ranks but "
                         f"extract_backend={backend!r} runs on one device: use vllm, hf-tp "
                         "or sglang")
    if devices.kind == "cuda":
        visible = visible_cuda_devices() if visible is None else visible
        if max(devices.ids) >= visible:
            where = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(
                f"gpus={settings.gpus!r} asks for device {max(devices.ids)} but {visible} "
                f"CUDA devices are visible" + (f" (CUDA_VISIBLE_DEVICES={where})" if where
                                               else ""))
    if backend == "sglang" and devices.kind != "cuda":
        raise ValueError("extract_backend='sglang' needs CUDA devices: --gpus 0-7, not cpu")


def devices_of(settings: Settings) -> Devices | None:
    """The replica's devices from the settings; None: the one-device worker, as before."""
    if settings.gpus:
        return parse_gpus(settings.gpus)
    if settings.extract_backend in DISTRIBUTED:  # a replica of one rank
        return parse_gpus("0" if visible_cuda_devices() else "cpu:1")
    return None


def is_replica(settings: Settings, devices: Devices) -> bool:
    """Several ranks, or a distributed backend even on one: else the one-device worker."""
    if settings.extract_backend == ENGINE:  # one process; the engine spans the devices
        return False
    return devices.ranks > 1 or settings.extract_backend in DISTRIBUTED


# -- launcher --------------------------------------------------------------------------------


def rank_env(devices: Devices, rank: int, port: int, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(devices.ranks),
                "LOCAL_WORLD_SIZE": str(devices.ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port), "DATAGEN_REPLICA_DEVICE": devices.kind})
    if devices.kind == "cuda":
        # indices are among the devices this process sees; every rank sees the replica's
        # devices and takes cuda:<rank> (what torchrun does)
        seen = base.get("CUDA_VISIBLE_DEVICES")
        order = seen.split(",") if seen else [str(i) for i in range(max(devices.ids) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(order[i] for i in devices.ids)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on the same cores
    return env


def launch(devices: Devices, celery_args: Sequence[str],
           env: dict[str, str] | None = None) -> int:
    """Start the ranks (our environment plus ``env``), watch them; the first to exit ends
    the replica."""
    port = free_port()
    base = {**os.environ, **(env or {})}
    procs = []
    for rank in range(devices.ranks):
        argv = [sys.executable, "-m", "datagen.extraction.replica", *celery_args]
        procs.append(subprocess.Popen(argv, env=rank_env(devices, rank, port, base)))
        log.info("replica rank %d pid %d (%s)", rank, procs[-1].pid,
                 f"cuda:{devices.ids[rank]}" if devices.kind == "cuda" else "cpu")
    def on_signal(_signum: int, _frame: Any) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)  # Celery's warm shutdown: the shard ends

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _watch(procs)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _watch(procs: list[subprocess.Popen]) -> int:
    first = _wait_first(procs)
    code = procs[first].returncode
    # a warm shutdown: rank 0 tells the others to stop, all exit 0 (in any order); a rank
    # that died takes the others down with it within moments: let them show it
    _wait_all(procs, 60.0 if code == 0 else 1.0)
    codes = [p.poll() for p in procs]
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    if all(c == 0 for c in codes):
        return 0
    log.error("replica stopped: %s; the shard it ran is re-run once its lease expires",
              ", ".join(f"rank {i} exited with {c}" if c is not None else
                        f"rank {i} killed by the launcher" for i, c in enumerate(codes)))
    return code if code and code > 0 else 1


def _wait_first(procs: list[subprocess.Popen]) -> int:
    while True:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                return i
        time.sleep(0.05)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


# -- ranks -----------------------------------------------------------------------------------


def announce(obj: Any, group: Any, timeout: timedelta) -> None:
    """Rank 0: send ``obj`` to the other ranks of ``group``; raises after ``timeout``."""
    import torch
    import torch.distributed as dist

    payload = pickle.dumps(obj)
    for tensor in (torch.tensor([len(payload)], dtype=torch.int64),
                   torch.frombuffer(bytearray(payload), dtype=torch.uint8)):
        dist.broadcast(tensor, src=0, group=group, async_op=True).wait(timeout=timeout)


def receive(group: Any) -> Any:
    """Ranks 1..N-1: the next object rank 0 announces (waits as long as the group lets)."""
    import torch
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


class Leader:
    """Rank 0's backend: announces each row to the other ranks, then runs its own part."""

    def __init__(self, backend: Any, group: Any, timeout: timedelta):
        self.inner, self.group, self.timeout = backend, group, timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_row(self, id_lists: Sequence[Sequence[int]], out: Any) -> None:
        try:
            announce([list(ids) for ids in id_lists], self.group, self.timeout)
            self.inner.forward_row(id_lists, out)
        except BaseException as exc:  # noqa: BLE001 - collectives are now out of step
            log.critical("replica forward failed (%s: %s): exiting; the shard's lease "
                         "expires and it is re-run", type(exc).__name__, exc)
            logging.shutdown()
            os._exit(EXIT_REPLICA_BROKEN)

    def close(self) -> None:
        try:
            announce(STOP, self.group, self.timeout)
        finally:
            self.inner.close()


def follow(backend: Any, group: Any, dtype: Any) -> None:
    """Ranks 1..N-1: run every row rank 0 announces, until it says stop."""
    import torch

    while True:
        row = receive(group)
        if row == STOP:
            return
        n = sum(len(ids) for ids in row)
        out = torch.empty(n, backend.width, dtype=dtype, device=backend.device)
        backend.forward_row(row, out)


def init_groups(settings: Settings, device: Any) -> Any:
    """The backend's process group (the default one) and the command group; returns the
    latter."""
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=settings.replica_timeout_s)
    if settings.extract_backend == "sglang":
        from specforge.distributed import init_distributed

        init_distributed(timeout=max(1, int(settings.replica_timeout_s // 60)),
                         tp_size=int(os.environ["WORLD_SIZE"]))
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def rank_main(argv: Sequence[str]) -> int:
    import torch
    import torch.distributed as dist

    from config.settings import load_settings
    from datagen.extraction import backends, runner

    logging.basicConfig(level=os.environ.get("DATAGEN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s rank" + os.environ["RANK"]
                        + " %(name)s: %(message)s", stream=sys.stderr)
    settings = load_settings(None)
    rank = int(os.environ["RANK"])
    device = (torch.device("cuda", int(os.environ["LOCAL_RANK"]))
              if os.environ["DATAGEN_REPLICA_DEVICE"] == "cuda" else torch.device("cpu"))
    group = init_groups(settings, device)
    cfg = runner.extraction_config(settings)
    backend = backends.create(cfg.backend, cfg, device)
    dist.barrier(group=group)  # every part loaded before rank 0 takes a shard
    try:
        if rank != 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher or rank 0 stops us
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            follow(backend, group, getattr(torch, cfg.dtype))
            backend.close()
            return 0
        leader = Leader(backend, group, timedelta(seconds=settings.replica_timeout_s))
        if os.environ.get(CALIBRATE_ENV):
            return _calibrate(settings, cfg, leader)
        return _serve(settings, cfg, leader, argv)
    finally:
        _leave()


def _leave() -> None:
    """Tear the process groups down before the rank exits (``exit_rank`` then skips the
    interpreter's own teardown)."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the exit code is about the work, not the teardown
        log.warning("process groups not torn down cleanly: %s", exc)


def _calibrate(settings: Settings, cfg: Any, leader: Leader) -> int:
    """`datagen calibrate` on a replica: tokens/s of the whole replica's forward."""
    import dataclasses

    import torch

    from datagen.extraction.estimate import save_calibration
    from datagen.extraction.extractor import Extractor

    seq_len, batches = (int(x) for x in os.environ[CALIBRATE_ENV].split(","))
    cfg = dataclasses.replace(cfg, max_length=max(seq_len, 1), batch_tokens=max(seq_len, 1),
                              check_free_space=False, states_to="files")  # no sink to time
    with Extractor(cfg, backend=leader) as ex:  # closing it stops the other ranks
        rate = ex.measure_forward(seq_len, batches)
    device = (torch.cuda.get_device_name() if leader.device.type == "cuda" else "cpu")
    save_calibration(settings.calibration_path, settings.model_path,
                     f"{device} x{os.environ['WORLD_SIZE']} ranks ({cfg.backend})", rate)
    return 0


def _serve(settings: Settings, cfg: Any, leader: Leader, argv: Sequence[str]) -> int:
    import workers.extract
    from datagen.extraction.extractor import Extractor
    from workers.app import app

    extractor = Extractor(cfg, backend=leader)
    workers.extract.install(extractor)
    log.info("replica of %s ranks ready (%s): consuming the gpu queue",
             os.environ["WORLD_SIZE"], cfg.backend)
    try:
        app.worker_main(["worker", "-Q", "gpu", "-P", "solo", "--loglevel", "INFO", "-E",
                         *argv])
    finally:
        extractor.close()  # drains the writers, then tells the other ranks to stop
    return 0


def exit_rank(argv: Sequence[str]) -> None:
    """Run the rank and leave with its exit code through ``os._exit``, once the logs are out.

    The interpreter's teardown is where it went wrong: gloo's threads destroyed while still
    joinable abort the process ("terminate called without an active exception"), a rank
    exiting -6 after a clean stop, even with the process groups destroyed first (rank 1, 1
    in ~4 runs of tests/test_replica_e2e.py with the suite in two processes; rank 0 once in
    later runs). By then the work is done: records renamed into place, Celery stopped."""
    code = 1
    try:
        code = rank_main(argv)
    except SystemExit as exc:  # Celery's worker ends with one
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    exit_rank(sys.argv[1:])
