"""A generation job: what a task message carries, and the prompt store it points into.

Messages carry ids and a file offset only (~300 bytes), not the prompt's token
ids: 100,000 queued prompts of 2K tokens would otherwise hold gigabytes of Redis
memory. The producer writes the tokenized prompts to ``prompts/<dataset>/``
under the shared output folder; a worker reads one line at the given offset.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datagen.client import INPUT_RESERVE, Limits
from datagen.errors import BadInput

PROMPTS_DIR = "prompts"


@dataclass(frozen=True)
class Job:
    dataset: str
    sample: str
    queue: str
    prompt_file: str  # relative to the output folder
    offset: int
    prompt_tokens: int
    max_new_tokens: int
    epoch: int = 0  # bumped when a closed dataset is reopened (stamped revokes are per epoch)
    # regenerate = "all": the assistant turns generated in order (max_new_tokens each), each
    # clamped by the worker to what context_length leaves after the turns before it; a turn
    # whose prompt reaches max_input_tokens (the server's max_req_input_len; 0: context - 6)
    # is not sent, the server would refuse it.
    turns: int = 1
    context_length: int = 0
    max_input_tokens: int = 0
    # cap_to_window: the row (prompt, every turn, the template's ids between) must fit in
    # this many tokens (train_max_length); the worker shares what is left among the turns
    # still to come. 0: not capped.
    window: int = 0

    def payload(self) -> dict[str, Any]:
        # Spelled out: dataclasses.asdict deep-copies and costs ~10x more per message.
        return {"dataset": self.dataset, "sample": self.sample, "queue": self.queue,
                "prompt_file": self.prompt_file, "offset": self.offset,
                "prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "epoch": self.epoch, "turns": self.turns, "context_length": self.context_length,
                "max_input_tokens": self.max_input_tokens, "window": self.window}

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Job:
        return cls(**payload)

    @property
    def stamp(self) -> str:
        return f"{self.dataset}#{self.epoch}"

    @property
    def limits(self) -> Limits | None:
        """What the server accepts, as the producer read it (None: unknown, not clamped)."""
        if not self.context_length:
            return None
        return Limits(self.context_length,
                      self.max_input_tokens or self.context_length - INPUT_RESERVE, "the task")

    @property
    def sample_cap(self) -> int:
        """The most tokens the whole sample may generate: what admission reserves."""
        cap = self.max_new_tokens * self.turns
        return min(cap, max(1, self.window - self.prompt_tokens)) if self.window else cap


@dataclass(frozen=True)
class Prompt:
    sample: str
    dataset: str
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    # regenerate = "all": per later turn, the template's ids between the turn before it and
    # its generation (the earlier turn's close, the next user turn, the generation prompt).
    turn_ids: list[list[int]] = field(default_factory=list)
    tools: list[Any] | None = None  # the function specs the template declared


class PromptStore:
    """Append-only JSONL of tokenized prompts, one file per producer run and dataset."""

    def __init__(self, output_dir: str | Path, dataset: str):
        self.output_dir = Path(output_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.relative = f"{PROMPTS_DIR}/{dataset}/run-{stamp}-{os.getpid()}.jsonl"
        self.path = self.output_dir / self.relative
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")  # noqa: SIM115 (closed in close())

    def add(self, sample: str, dataset: str, messages: list[dict[str, Any]],
            prompt_ids: list[int], turn_ids: list[list[int]] | None = None,
            tools: list[Any] | None = None) -> int:
        """Append one prompt; returns its byte offset."""
        offset = self._fh.tell()
        entry: dict[str, Any] = {"id": sample, "dataset": dataset, "messages": messages,
                                 "prompt_ids": prompt_ids}
        if turn_ids:
            entry["turn_ids"] = turn_ids
        if tools:
            entry["tools"] = tools
        line = json.dumps(entry, separators=(",", ":"), ensure_ascii=False)
        self._fh.write(line.encode("utf-8") + b"\n")
        return offset

    def flush(self) -> None:
        """Flush and fsync: a worker on another host may read these bytes next."""
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self.flush()
        self._fh.close()


def read_prompt(output_dir: str | Path, job: Job) -> Prompt:
    path = Path(output_dir) / job.prompt_file
    try:
        with open(path, "rb") as fh:
            fh.seek(job.offset)
            data = json.loads(fh.readline())
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot read prompt {job.sample!r} at {path}:{job.offset}: {exc}") from exc
    if data.get("id") != job.sample:
        raise BadInput(f"prompt store {path} at offset {job.offset} holds {data.get('id')!r}, "
                       f"not {job.sample!r}")
    turn_ids = data.get("turn_ids") or []
    if len(turn_ids) != job.turns - 1:
        raise BadInput(f"prompt {job.sample!r} at {path}:{job.offset} has {len(turn_ids) + 1} "
                       f"turns, the task {job.turns}")
    return Prompt(job.sample, job.dataset, data["messages"], data["prompt_ids"], turn_ids,
                  data.get("tools"))
