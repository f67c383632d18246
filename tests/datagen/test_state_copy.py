"""The connector's copy and write path on plain tensors (datagen/extraction/state_copy.py):
what runs inside vLLM's engine when requests end, without vLLM."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from datagen.extraction.files import save_atomic
from datagen.extraction.state_copy import StateCopier, StateLayout, rms_norm
from datagen.extraction.state_sink import (
    SafetensorsSink,
    TorchSink,
    release_lock,
    write_failure,
)
from datagen.servers import capture

BLOCK, IDS, HIDDEN = 4, 3, 8
SLOTS = (1, 0, 0, 2)  # aux ids in the file's order (one repeated), then the last layer's
META = {"aux_layer_ids": "[1, 0, 0]", "hidden_state": "post-norm"}


def layout(dtype: torch.dtype = torch.bfloat16) -> StateLayout:
    norm = (torch.arange(HIDDEN, dtype=torch.float32) / 7 + 0.5).to(dtype)
    return StateLayout(SLOTS, norm, 1e-6, dtype)


def cache(blocks: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
          ) -> torch.Tensor:
    """vLLM's hidden-states group: [blocks, ids, block_size, H]."""
    gen = torch.Generator().manual_seed(blocks)
    return torch.randn(blocks, IDS, BLOCK, HIDDEN, generator=gen).to(dtype).to(device)


def whole(kv: torch.Tensor, blocks: list[int], n: int, lay: StateLayout
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The connector's path before: every row of the request gathered at once
    (vLLM's extract_from_kv_cache), then the aux slots and the norm over all of them."""
    b = torch.tensor(blocks)
    slots = (torch.arange(BLOCK)[None, :] + b[:, None] * BLOCK).flatten()
    rows = kv[slots // BLOCK, :, slots % BLOCK][:n].cpu()
    aux = rows[:, list(lay.slots[:-1]), :].reshape(n, (len(lay.slots) - 1) * HIDDEN)
    return (aux.to(lay.dtype).contiguous(),
            rms_norm(rows[:, lay.slots[-1], :], lay.norm, lay.eps).contiguous())


def requests(count: int, blocks_each: int, total: int) -> list[tuple[list[int], int]]:
    """Scattered blocks; lengths that end mid-block, on a block's edge, inside one block."""
    gen = torch.Generator().manual_seed(count)
    order = torch.randperm(total, generator=gen).tolist()
    out = []
    for i in range(count):
        blocks = order[i * blocks_each:(i + 1) * blocks_each]
        n = (blocks_each * BLOCK, blocks_each * BLOCK - 3, 2)[i % 3]
        out.append((blocks, n))
    return out


class Done:
    def __init__(self) -> None:
        self.errors: dict[str, str | None] = {}
        self.lock = threading.Lock()

    def __call__(self, job, error) -> None:
        with self.lock:
            self.errors[job.req_id] = error


def pumped(copier: StateCopier) -> set[str]:
    released: set[str] = set()
    while copier.pending():
        released |= copier.pump()
    return released


def test_files_written_chunk_by_chunk_equal_the_whole_request_path_byte_for_byte(
        tmp_path: Path) -> None:
    # Given: requests of several lengths in scattered blocks, chunks of 2 blocks through
    # 2 host buffers
    lay, kv = layout(), cache(40)
    reqs = requests(6, 5, 40)
    done, pool = Done(), ThreadPoolExecutor(3)
    copier = StateCopier(kv, lay, pool, chunk_blocks=2, host_buffers=2)
    widths = lay.widths(HIDDEN)

    # When: each is written as a capture file and as an extraction file
    for i, (blocks, n) in enumerate(reqs):
        ids = torch.arange(n) + 100 * i
        mask = (torch.arange(n) >= 1).to(torch.int64)
        copier.submit(f"s{i}", blocks, n, SafetensorsSink(
            tmp_path / f"s{i}.safetensors", ids, widths, lay.dtype, META), done)
        copier.submit(f"t{i}", blocks, n, TorchSink(
            tmp_path / f"t{i}.ckpt", ids, mask, widths, lay.dtype), done)
    assert pumped(copier) == {f"{k}{i}" for k in "st" for i in range(len(reqs))}
    pool.shutdown(wait=True)

    # Then: every file is the one the whole-request path wrote, byte for byte
    assert set(done.errors.values()) == {None}
    for i, (blocks, n) in enumerate(reqs):
        ids = torch.arange(n) + 100 * i
        aux, final = whole(kv, blocks, n, lay)
        save_file({"input_ids": ids, "aux_hidden_state": aux, "hidden_state": final},
                  str(tmp_path / "old.safetensors"), META)
        assert _same_safetensors(tmp_path / f"s{i}.safetensors", tmp_path / "old.safetensors")
        save_atomic(tmp_path / "old" / f"t{i}.ckpt", {
            "input_ids": ids, "loss_mask": (torch.arange(n) >= 1).to(torch.int64),
            "aux_hidden_state": aux.unsqueeze(0), "hidden_state": final.unsqueeze(0)})
        assert _same_zip(tmp_path / f"t{i}.ckpt", tmp_path / "old" / f"t{i}.ckpt")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _same_zip(a: Path, b: Path) -> bool:
    """Equal records, byte for byte, but for the archive's folder name (torch.save names it
    after the temporary file, which names the writer thread)."""
    def records(p: Path) -> list[tuple[str, bytes]]:
        with zipfile.ZipFile(p) as z:
            return [(i.filename.partition("/")[2], z.read(i)) for i in z.infolist()]
    return records(a) == records(b)


def _same_safetensors(a: Path, b: Path) -> bool:
    """Equal bytes but for the order of the metadata's keys (safetensors' own save_file
    orders them at random: two of its writes of one dict differ there)."""
    def parts(p: Path) -> tuple[int, dict, bytes]:
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        return n, json.loads(raw[8:8 + n]), raw[8 + n:]
    return parts(a) == parts(b)


def test_the_streamed_header_is_safetensors_own_to_the_byte(tmp_path: Path) -> None:
    lay, kv = layout(torch.float32), cache(8, torch.float32)
    done, pool = Done(), ThreadPoolExecutor(1)
    copier = StateCopier(kv, lay, pool, chunk_blocks=1, host_buffers=1)
    ids = torch.arange(7)
    copier.submit("r", [3, 5], 7, SafetensorsSink(tmp_path / "new.safetensors", ids,
                                                  lay.widths(HIDDEN), lay.dtype), done)
    pumped(copier)
    pool.shutdown(wait=True)
    aux, final = whole(kv, [3, 5], 7, lay)
    save_file({"input_ids": ids, "aux_hidden_state": aux, "hidden_state": final},
              str(tmp_path / "old.safetensors"))
    assert ((tmp_path / "new.safetensors").read_bytes()
            == (tmp_path / "old.safetensors").read_bytes())


class Gate:
    """A writer held until the test opens it: the disk as slow as the test wants, without
    depending on how fast this machine is."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)

    def wrap(self, sink):
        write = sink.write

        def held(start, aux, final):
            self.entered.release()
            assert self.open.wait(30)
            write(start, aux, final)
        sink.write = held
        return sink


def test_many_long_requests_ending_together_wait_in_their_blocks_not_in_memory(
        tmp_path: Path) -> None:
    # Given: 24 requests of 20 blocks each ending in one step, 2 host buffers of 2 blocks,
    # and writers that do not finish until the test lets them
    lay, kv = layout(), cache(480)
    reqs = requests(24, 20, 480)
    gate, done, pool = Gate(), Done(), ThreadPoolExecutor(4)
    copier = StateCopier(kv, lay, pool, chunk_blocks=2, host_buffers=2)
    for i, (blocks, n) in enumerate(reqs):
        copier.submit(f"r{i}", blocks, n, gate.wrap(SafetensorsSink(
            tmp_path / f"r{i}.safetensors", torch.arange(n), lay.widths(HIDDEN), lay.dtype)),
            done)

    # When: the engine steps while the writers are behind
    released = copier.pump()
    for _ in range(2):  # both buffers' chunks are with the writers
        assert gate.entered.acquire(timeout=30)
    for _ in range(5):
        released |= copier.pump()

    # Then: both buffers are out, nothing more was copied, and every request keeps its blocks
    assert copier.pool.out == 2 and released == set()
    assert all(copier.busy(f"r{i}") for i in range(len(reqs)))
    assert copier.waits >= 5

    # When: the writers catch up
    gate.open.set()
    released |= pumped(copier)
    pool.shutdown(wait=True)

    # Then: every request was released once all of it was on the host, the host never held
    # more than its 2 buffers, and every file is complete
    assert released == {f"r{i}" for i in range(len(reqs))}
    assert copier.pool.peak_out == 2 and copier.pool.out == 0
    assert set(done.errors.values()) == {None}
    for i, (blocks, n) in enumerate(reqs):
        aux, final = whole(kv, blocks, n, lay)
        from safetensors.torch import load_file
        got = load_file(str(tmp_path / f"r{i}.safetensors"))
        assert torch.equal(got["aux_hidden_state"], aux)
        assert torch.equal(got["hidden_state"], final)


def test_samples_assembled_for_torch_save_are_admitted_within_their_budget(
        tmp_path: Path) -> None:
    # Given: extraction files of 640 assembled bytes each ((3 + 1) * 8 * 2 B * 10 positions),
    # a budget of 1000 bytes: one at a time, however many end together; the engine's step
    # runs in inference mode, as vLLM's does
    lay, kv = layout(), cache(30)
    done, pool = Done(), ThreadPoolExecutor(2)
    copier = StateCopier(kv, lay, pool, chunk_blocks=1, host_buffers=4, assembly_bytes=1000)
    with torch.inference_mode():
        for i in range(5):
            blocks = list(range(3 * i, 3 * i + 3))
            copier.submit(f"t{i}", blocks, 10, TorchSink(
                tmp_path / f"t{i}.ckpt", torch.arange(10), torch.ones(10, dtype=torch.int64),
                lay.widths(HIDDEN), lay.dtype), done)
        pumped(copier)
    pool.shutdown(wait=True)
    assert copier.peak_assembling == 640
    assert set(done.errors) == {f"t{i}" for i in range(5)} and set(done.errors.values()) == {None}
    for i in range(5):
        got = torch.load(tmp_path / f"t{i}.ckpt")
        aux, final = whole(kv, list(range(3 * i, 3 * i + 3)), 10, lay)
        assert torch.equal(got["aux_hidden_state"][0], aux)
        assert torch.equal(got["hidden_state"][0], final)


def full_disk(after: int):
    """os.pwrite that fails with ENOSPC from its ``after``-th call on."""
    calls = {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwrite(fd, data, offset)
    return pwrite


def test_a_full_disk_fails_its_file_alone_with_the_folder_and_its_free_space(
        tmp_path: Path) -> None:
    # Given: three requests; the second one's disk fills after its header and ids
    lay, kv = layout(), cache(30)
    done, pool = Done(), ThreadPoolExecutor(2)
    copier = StateCopier(kv, lay, pool, chunk_blocks=1, host_buffers=2)
    widths = lay.widths(HIDDEN)
    for i in range(3):
        sink = SafetensorsSink(tmp_path / f"r{i}.safetensors", torch.arange(12), widths,
                               lay.dtype, pwrite=full_disk(2) if i == 1 else os.pwrite)
        copier.submit(f"r{i}", list(range(3 * i, 3 * i + 3)), 12, sink, done)

    # When: the engine steps until all are off the cache
    released = pumped(copier)
    pool.shutdown(wait=True)

    # Then: all three released their blocks and the writers went on; the failed file left
    # no file and no temporary, and its error names the folder and its free space
    assert released == {"r0", "r1", "r2"} and copier.pool.out == 0 and copier.failed == 1
    assert done.errors["r0"] is None and done.errors["r2"] is None
    error = done.errors["r1"]
    assert error is not None and error.errno == errno.ENOSPC
    assert f"no space left on device under {tmp_path} (" in str(error)
    assert "bytes free, the file needs" in str(error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0.safetensors", "r2.safetensors"]


def test_a_failed_write_tells_the_worker_why_through_its_lock(tmp_path: Path) -> None:
    # Given: the lock the connector holds for an attempt's file, and its write failing on a
    # full disk
    path = tmp_path / "r1.safetensors"
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert capture.write_failure(path) is None
    error = write_failure(path, OSError(errno.ENOSPC, "No space left on device"), 4096)

    # When: the write ends
    release_lock(fd, error)

    # Then: the worker's check says why there is no file, naming the folder and its space
    failed = capture.write_failure(path)
    assert failed is not None and failed.errno == errno.ENOSPC
    assert f"no space left on device under {tmp_path} (" in str(failed)
    with pytest.raises(capture.CaptureMismatch, match=r"not written \(\[Errno 28\] r1.*"
                                                      r"bytes free, the file needs 4096"):
        capture.check_file(path, [1, 2, 3])
    assert capture.wait_released(path, 1.0)
    # a write that ended well leaves nothing to read
    ok = tmp_path / "r2.safetensors"
    release_lock(os.open(f"{ok}.lock", os.O_CREAT | os.O_WRONLY, 0o644), None)
    assert capture.write_failure(ok) is None and capture.write_failure(tmp_path / "x") is None


@pytest.mark.gpu
def test_on_cuda_the_copy_goes_through_pinned_buffers_and_one_staging_chunk(
        tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the CUDA copy (side stream, pinned buffers, "
                    "staging chunk) runs where a GPU and torch are")
    # Given: a cache on the GPU and long requests ending together
    lay, kv = layout(), cache(400, device="cuda")
    reqs = requests(10, 40, 400)
    done, pool = Done(), ThreadPoolExecutor(4)
    copier = StateCopier(kv, lay, pool, chunk_blocks=4, host_buffers=3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i, (blocks, n) in enumerate(reqs):
        copier.submit(f"r{i}", blocks, n, SafetensorsSink(
            tmp_path / f"r{i}.safetensors", torch.arange(n), lay.widths(HIDDEN), lay.dtype),
            done)

    # When: the engine steps until all are on the host
    released = pumped(copier)
    pool.shutdown(wait=True)

    # Then: the GPU held one staging chunk beyond the cache (and the index tensors), the
    # host buffers were pinned, and every file equals the whole-request path's
    chunk = 4 * IDS * BLOCK * HIDDEN * 2
    assert torch.cuda.max_memory_allocated() - base <= chunk + 64 * 1024
    assert copier.pool.peak_out <= 3 and copier.pool._free[0].is_pinned()
    assert released == {f"r{i}" for i in range(len(reqs))}
    from safetensors.torch import load_file
    for i, (blocks, n) in enumerate(reqs):
        aux, final = whole(kv, blocks, n, lay)
        got = load_file(str(tmp_path / f"r{i}.safetensors"))
        assert torch.equal(got["aux_hidden_state"], aux)
        assert torch.equal(got["hidden_state"], final)
