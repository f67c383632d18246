"""Publisher against the real plane: a sample put through Mooncake comes back byte-equal with
SpecForge's own MooncakeFeatureStore.get, under the stream's names and shapes."""

from __future__ import annotations

import json

import pytest
import torch

from datagen.errors import BadInput, ConsumerFailed
from datagen.extraction.files import Sample, sample_tensors
from datagen.stream.plane import key_count
from datagen.stream.publisher import (
    Publisher,
    channel_sample_ids,
    read_witness,
    stream_tensors,
    tensor_digest,
)

HIDDEN = 16


def file_sample(idx: int, n: int = 11) -> dict[str, torch.Tensor]:
    """A sample's tensors exactly as the file build makes them (files.sample_tensors)."""
    gen = torch.Generator().manual_seed(idx)
    sample = Sample(idx=idx, id=f"s{idx}", dataset="A1",
                    input_ids=torch.randint(0, 300, (n,), generator=gen).tolist(),
                    n_prompt=4, truncated=False)
    aux = torch.randn(1, n, 3 * HIDDEN, generator=gen).bfloat16()
    final = torch.randn(1, n, HIDDEN, generator=gen).bfloat16()
    return sample_tensors(sample, aux, final)


def consumer_store(info):
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    return MooncakeFeatureStore(store_id=info.store_id, setup_kwargs=info.setup_kwargs())


def published_refs(info) -> list[dict]:
    return [json.loads(x) for x in open(info.channel_path, encoding="utf-8")]


@pytest.fixture(scope="module")
def publisher(mooncake_plane):
    return Publisher(mooncake_plane.info)


def test_a_put_sample_comes_back_byte_equal_under_the_stream_names(mooncake_plane, publisher):
    info = mooncake_plane.info
    tensors = file_sample(1)
    nbytes = publisher.put("A1/s1@e1", tensors)
    assert nbytes == 11 * 8 * 3 + 11 * (3 * HIDDEN + HIDDEN) * 2
    [ref_dict] = [r for r in published_refs(info) if r["sample_id"] == "A1/s1@e1"]
    assert ref_dict["strategy"] == "eagle3" and ref_dict["schema_version"] == 1
    assert ref_dict["metadata"]["target_repr"] == "hidden_state"
    assert ref_dict["metadata"]["generation"] >= 1
    from specforge.runtime.data_plane.ref_serialization import ref_from_dict

    store = consumer_store(info)  # another client, as the consumer is
    got, handle = store.get(ref_from_dict(ref_dict))
    expected = {"input_ids": tensors["input_ids"].view(1, -1),
                "loss_mask": tensors["loss_mask"].view(1, -1),
                "attention_mask": torch.ones(1, 11, dtype=torch.int64),
                "hidden_state": tensors["aux_hidden_state"],
                "target": tensors["hidden_state"]}
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert got[name].view(torch.uint8).equal(want.contiguous().view(torch.uint8)), name
    keys = key_count(info)
    assert keys >= len(expected)  # one object per tensor
    # the consumer frees it as after its optimizer step (a read lease defers the remove)
    store.release(handle)
    store.drain_pending_removals(retry_interval_s=0.1)
    assert key_count(info) == keys - len(expected)


def test_a_second_put_of_one_id_publishes_and_stores_nothing(mooncake_plane, publisher):
    info = mooncake_plane.info
    assert publisher.put("A1/s2@e1", file_sample(2)) > 0
    keys, lines = key_count(info), len(published_refs(info))
    assert publisher.put("A1/s2@e1", file_sample(2)) == 0
    # a publisher that replaces a dead one reads what was published before it
    assert Publisher(info).put("A1/s2@e1", file_sample(2)) == 0
    assert (key_count(info), len(published_refs(info))) == (keys, lines)
    assert "A1/s2@e1" in channel_sample_ids(info.channel_path)
    # epoch 2 is another id: published again
    assert publisher.put("A1/s2@e2", file_sample(2)) > 0


def test_each_put_leaves_one_witness_line_with_the_digests_of_what_was_streamed(
        mooncake_plane, publisher):
    """published.jsonl: one line per put (none for a re-put), the sha256, shape and dtype of
    each tensor the trainer is handed, its bytes and epoch; no states in it."""
    info = mooncake_plane.info
    tensors = file_sample(5, n=9)
    nbytes = publisher.put("A1/s5@e2", tensors)
    assert publisher.put("A1/s5@e2", tensors) == 0
    [line] = [x for x in read_witness(info.dir) if x["sample_id"] == "A1/s5@e2"]
    assert line["epoch"] == 2 and line["bytes"] == nbytes
    streamed = stream_tensors(tensors)
    assert set(line["tensors"]) == set(streamed)
    for name, t in streamed.items():
        assert line["tensors"][name] == {"sha256": tensor_digest(t), "shape": list(t.shape),
                                         "dtype": str(t.dtype).removeprefix("torch.")}, name
    # the digest is of the bytes: another state gives another digest
    other = stream_tensors(file_sample(6, n=9))["hidden_state"]
    assert line["tensors"]["hidden_state"]["sha256"] != tensor_digest(other)
    assert (info.dir / "published.jsonl").stat().st_size < 4096  # digests, not states


def test_the_consumer_ledger_drops_a_duplicate_two_publishers_raced_on(tmp_path):
    """Two publishers that both published one id: SpecForge's consumer.sqlite commits the
    first ref and reports the second not fresh (it is never trained twice)."""
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    store = LocalFeatureStore()
    first = store.put({"input_ids": torch.ones(1, 3, dtype=torch.int64)}, sample_id="A1/s3@e1",
                      metadata={"strategy": "eagle3"})
    again = store.put({"input_ids": torch.ones(1, 3, dtype=torch.int64)}, sample_id="A1/s3@e1",
                      metadata={"strategy": "eagle3"})
    db = SQLiteMetadataStore(str(tmp_path / "consumer.sqlite"))
    assert db.commit_samples([first, again]) == [True, False]


def test_a_sample_missing_a_tensor_is_a_clear_error(publisher):
    tensors = file_sample(4)
    del tensors["aux_hidden_state"]
    with pytest.raises(BadInput, match="lacks \\['aux_hidden_state'\\]"):
        publisher.put("A1/s4@e1", tensors)


def test_wait_ready_names_a_failed_consumer(mooncake_plane, tmp_path):
    publisher = Publisher(mooncake_plane.info, tmp_path / "refs.jsonl")
    publisher.channel.mark_consumer_failed("out of memory")
    with pytest.raises(ConsumerFailed, match="out of memory"):
        publisher.wait_ready(timeout_s=30)
