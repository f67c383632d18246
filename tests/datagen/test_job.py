"""Task payloads and the prompt store they point into."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from datagen.errors import BadInput
from datagen.generation.job import Job, PromptStore, read_prompt


def test_payload_round_trips_every_field() -> None:
    job = Job("B1", "s/1", "long", "prompts/B1/x.jsonl", 123, 45, 678, epoch=2)
    assert set(job.payload()) == {f.name for f in dataclasses.fields(Job)}
    assert Job.from_payload(job.payload()) == job
    assert job.stamp == "B1#2"


def test_a_worker_reads_the_prompt_at_its_offset(tmp_path: Path) -> None:
    store = PromptStore(tmp_path, "B1")
    offsets = [store.add(f"s{i}", "B1", [{"role": "user", "content": f"q{i}"}], [i, i + 1])
               for i in range(3)]
    store.close()
    job = Job("B1", "s2", "short", store.relative, offsets[2], 2, 10)
    prompt = read_prompt(tmp_path, job)
    assert prompt.prompt_ids == [2, 3] and prompt.messages[0]["content"] == "q2"
    wrong = dataclasses.replace(job, offset=offsets[1])
    with pytest.raises(BadInput, match="holds 's1', not 's2'"):
        read_prompt(tmp_path, wrong)
