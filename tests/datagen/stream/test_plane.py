"""The Mooncake plane: a real mooncake_master and segment holder on loopback."""

from __future__ import annotations

import json
import os

import pytest
import torch

from datagen.errors import BadInput
from datagen.stream.plane import PLANE_NAME, Plane, PlaneInfo, key_count, metrics


def test_plane_answers_and_describes_itself(mooncake_plane):
    info = PlaneInfo.read(mooncake_plane.dir)
    assert info == mooncake_plane.info
    assert info.master_addr.startswith("127.0.0.1:") and info.protocol == "tcp"
    gauges = metrics(info.metrics_url)
    # the holder mounted its whole segment with the master
    assert gauges["master_total_capacity_bytes"] == info.segment_bytes
    assert key_count(info) == 0
    # master and holder each lead a process group of their own (stopped as a group)
    for proc in (mooncake_plane.master, mooncake_plane.holder):
        assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    assert info.holder_pid == mooncake_plane.holder.pid
    env = info.env()
    assert env["DISAGG_STORE_ID"] == info.store_id
    assert env["DISAGG_REF_CHANNEL"] == info.channel_path
    assert env["MOONCAKE_METADATA_SERVER"] == info.metadata_url


def test_stop_ends_both_processes(tmp_path):
    plane = Plane(tmp_path, segment_bytes=64 << 20)
    with plane:
        procs = [plane.master, plane.holder]
        assert (tmp_path / PLANE_NAME).is_file()
    assert all(p.poll() is not None for p in procs)


def test_a_folder_without_a_plane_is_a_clear_error(tmp_path):
    with pytest.raises(BadInput, match=f"{tmp_path / PLANE_NAME} is missing"):
        PlaneInfo.read(tmp_path)
    (tmp_path / PLANE_NAME).write_text("{\"master_addr\": 1}")
    with pytest.raises(BadInput, match="not a plane description"):
        PlaneInfo.read(tmp_path)


def test_a_restarted_holder_takes_new_puts_and_what_the_dead_one_held_is_gone(tmp_path):
    """A SIGKILLed holder takes its bytes with it: a published sample cannot be read back;
    once restarted (after the master unmounted the dead segment) puts and gets work again."""
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    from datagen.stream.publisher import Publisher

    tensors = {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.int64),
               "aux_hidden_state": torch.randn(1, 5, 12), "hidden_state": torch.randn(1, 5, 4)}
    plane = Plane(tmp_path, segment_bytes=64 << 20)
    with plane as info:
        publisher = Publisher(info)
        publisher.put("A1/a@e1", tensors)
        old_pid = info.holder_pid
        info = plane.restart_holder()
        assert info.holder_pid != old_pid and PlaneInfo.read(tmp_path).holder_pid == info.holder_pid
        assert key_count(info) == 0
        reader = MooncakeFeatureStore(store_id=info.store_id, setup_kwargs=info.setup_kwargs())
        from specforge.runtime.data_plane.ref_serialization import ref_from_dict

        refs = [ref_from_dict(json.loads(x)) for x in open(info.channel_path, encoding="utf-8")]
        with pytest.raises(KeyError):
            reader.get(refs[0])
        publisher.put("A1/b@e1", tensors)
        refs = [ref_from_dict(json.loads(x)) for x in open(info.channel_path, encoding="utf-8")]
        got, _ = reader.get(refs[1])
        assert got["target"].equal(tensors["hidden_state"].bfloat16())
