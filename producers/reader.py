"""Read prompt datasets from a partition folder, one normalised prompt at a time.

A partition holds one entry per dataset: a folder of data files (read recursively, in sorted
path order) or a single data file, `<name>.jsonl`, `<name>.jsonl.gz`, `<name>.jsonl.zst` or
`<name>.parquet` (``producers.files`` reads each form as a stream). Each line, or parquet row,
is one record in one of four shapes:

    OpenAI     {"messages": [{"role": "user", "content": "..."}], "tools": [...], "id": ...}
    ShareGPT   {"conversations": [{"from": "human", "value": "..."}], "tools": "[...]"}
    SpecForge  {"id": ..., "conversations": [{"role": "user", "content": "..."}]}
    plain      {"prompt": "...", "system": "..."}

Agent turns (``tools``, assistant ``tool_calls`` and ``reasoning_content``, ``tool`` results,
multi-part content, ShareGPT's ``function_call``/``observation``) are read into one model,
``datagen.conversation``'s normalised OpenAI messages. A trailing assistant turn is dropped:
it is the answer the target model regenerates; the prompt then ends on a user or a tool turn.
Every record that cannot become a prompt is reported as a `BadRecord` naming its file and line
(a parquet row: its index in the file), and reading goes on with the next one. JSON lines are
read in binary and decoded one at a time, so memory does not grow with the text (only an index
of 64-bit digests, ~130 bytes a record, to catch duplicates); one line with bad bytes costs one
record, not the file. A parquet row reaches the same code as the dict pyarrow makes of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from datagen.conversation import (
    PROMPT_ENDS,
    ConversationError,
    Message,
    core,
    event_cuts,
    json_type,
    messages_of,
    text_of,
    tools_of,
)
from producers.files import Row, Unreadable, dataset_files, dataset_name, form_of, numbered_rows

logger = logging.getLogger(__name__)

# Dataset names become path components and Redis key parts downstream, so nothing that could
# climb out of a folder ("..", "/") or hide a file (leading ".") may pass.
# Always fullmatch: with match(), "$" would also accept a name ending in a newline.
DATASET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SAFE_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
ID_KEYS = ("id", "sample_id", "uuid")
# The record keys the shapes read: a parquet file's other columns are never loaded.
RECORD_KEYS = ("messages", "conversations", "prompt", "system", "tools", *ID_KEYS)


@dataclass(frozen=True)
class Prompt:
    """One prompt ready for the chat template.

    sample_id is stable across runs: the record's own id when it has one, else a digest of the
    dataset name and the messages. A record's own id may hold any characters: treat it as data,
    never as a path or file name unless `is_safe_id` says so (else use a digest of it).
    """

    dataset: str
    sample_id: str
    messages: tuple[Message, ...]  # up to the turn generated (the last is user or tool)
    source: str  # "path:line", for error messages
    tools: tuple[Any, ...] | None = None  # the record's function specs, for the template
    answer: Message | None = None  # the trailing assistant turn the prompt was cut before

    def events(self) -> list[Prompt]:
        """regenerate = "each": one prompt per assistant turn, each cut before it, plus the
        turn after the last (this prompt's own). Ids: ``<sample_id>:<n>``, n from 1."""
        turns = (*self.messages, self.answer) if self.answer is not None else self.messages
        return [replace(self, sample_id=f"{self.sample_id}:{n}", messages=turns[:cut],
                        answer=turns[cut] if cut < len(turns) else None)
                for n, cut in enumerate(event_cuts(turns), start=1)]


@dataclass(frozen=True)
class BadRecord:
    """A line that could not become a prompt, and why."""

    dataset: str
    path: str
    line: int  # a line from 1; a parquet row's index from 0
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def is_safe_id(sample_id: str) -> bool:
    """Whether an id may be used as-is inside a file name or a Redis key."""
    return SAFE_ID_RE.fullmatch(sample_id) is not None


class _Invalid(Exception):
    """Raised while parsing one line; its message becomes the BadRecord reason."""


def discover_datasets(
    partition_dir: Path, selection: str | Sequence[str] = "all"
) -> list[tuple[str, Path]]:
    """(name, path) of the selected datasets in a partition: sorted by name for "all", else in
    the order asked. Raises ValueError for an unsafe or unknown name, naming the ones available."""
    available = _scan_partition(Path(partition_dir))
    names = _parse_selection(selection)
    if names is None:
        return sorted(available.items())
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(
            f"unknown dataset(s) {', '.join(unknown)} in {partition_dir}; "
            f"available: {', '.join(sorted(available)) or '(none)'}"
        )
    return [(name, available[name]) for name in names]


def _check_name(name: str, where: str) -> None:
    if not DATASET_NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid dataset name {name!r} {where}: names must match {DATASET_NAME_RE.pattern}"
        )


def _scan_partition(partition_dir: Path) -> dict[str, Path]:
    if not partition_dir.is_dir():
        raise ValueError(f"partition folder {partition_dir} does not exist or is not a folder")
    found: dict[str, Path] = {}
    for entry in sorted(partition_dir.iterdir()):
        if entry.name.startswith((".", "_")):
            continue  # editor, VCS and metadata files
        if entry.is_dir():
            name = entry.name
            if not dataset_files(entry):
                logger.warning("skipping %s: no data files (.jsonl, .jsonl.gz, .jsonl.zst, "
                               ".parquet) in it", entry)
                continue
        elif form_of(entry) is not None:
            name = dataset_name(entry)
        else:
            continue
        _check_name(name, f"in partition {partition_dir}")
        if name in found:
            raise ValueError(f"dataset {name!r} is both {found[name]} and {entry}")
        found[name] = entry
    return found


def _parse_selection(selection: str | Sequence[str]) -> list[str] | None:
    """Requested names in order without repeats, or None for all."""
    raw = selection.split(",") if isinstance(selection, str) else list(selection)
    names = list(dict.fromkeys(name.strip() for name in raw if name.strip()))
    if not names:
        raise ValueError(f"empty dataset selection {selection!r}; use 'all' or a list of names")
    if "all" in names:
        return None
    for name in names:
        _check_name(name, "in the dataset selection")
    return names


def read_dataset(name: str, path: Path) -> Iterator[Prompt | BadRecord]:
    """Yield every line of a dataset as a Prompt or a BadRecord, in file and line order.

    A repeated sample id or repeated messages within the dataset are reported as duplicates of
    the first occurrence, which wins.
    """
    _check_name(name, f"for {path}")
    seen = _SeenIndex()
    for file in dataset_files(Path(path)):
        for line_no, row in numbered_rows(file, RECORD_KEYS):
            yield _parse_line(name, file, line_no, row, seen)


class _SeenIndex:
    """First location of every record id and message digest seen in one dataset.

    Keys and locations are packed into plain ints (~130 bytes a record), so a million-line
    dataset needs about 130 MB here and nothing else grows with the file.
    """

    def __init__(self) -> None:
        self._files: list[str] = []
        self._by_id: dict[int, int] = {}
        self._by_content: dict[int, int] = {}

    def first_of(self, own_id: str | None, canonical: bytes, file: str, line: int) -> str | None:
        """The earlier "path:line (same ...)" for a duplicate; else record this one and None.

        Content-derived ids are a function of the messages, so the content index covers them.
        """
        content_key = _digest64(canonical)
        id_key = None if own_id is None else _digest64(own_id.encode("utf-8"))
        for key, index, what in ((content_key, self._by_content, "messages"),
                                 (id_key, self._by_id, "id")):
            if key is not None and key in index:
                return f"{self._files[index[key] >> 32]}:{index[key] & 0xFFFFFFFF} (same {what})"
        if not self._files or self._files[-1] != file:
            self._files.append(file)
        here = (len(self._files) - 1) << 32 | line
        self._by_content[content_key] = here
        if id_key is not None:
            self._by_id[id_key] = here
        return None


def _digest64(data: bytes) -> int:
    # 64 bits: a chance collision among a million records is about 3 in 100 million.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _parse_line(
    dataset: str, file: Path, line_no: int, row: Row, seen: _SeenIndex
) -> Prompt | BadRecord:
    try:
        record = _load_object(row)
        messages, answer, tools = _conversation(record)
        canonical = _canonical(messages, tools)
        own_id = _record_id(record)
    except _Invalid as exc:
        return BadRecord(dataset, str(file), line_no, str(exc))
    first = seen.first_of(own_id, canonical, str(file), line_no)
    if first is not None:
        return BadRecord(dataset, str(file), line_no, f"duplicate of {first}")
    sample_id = own_id or _content_id(dataset, canonical)
    return Prompt(dataset, sample_id, messages, f"{file}:{line_no}", tools, answer)


def _load_object(raw: Row) -> dict[str, Any]:
    if isinstance(raw, Unreadable):
        raise _Invalid(raw.reason)
    if isinstance(raw, dict):
        return raw  # a parquet row
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"not valid UTF-8 at byte {exc.start} of the line") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Invalid(f"invalid JSON: {exc.msg} (col {exc.colno})") from None
    except RecursionError:
        raise _Invalid("invalid JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise _Invalid(f"expected a JSON object, got {json_type(record)}")
    return record


def _conversation(record: dict[str, Any]
                  ) -> tuple[tuple[Message, ...], Message | None, tuple[Any, ...] | None]:
    """(the prompt's messages, the trailing assistant turn dropped or None, the tools)."""
    try:
        if "messages" in record:
            turns = messages_of(record["messages"], "messages")
        elif "conversations" in record:
            turns = _with_system(record, messages_of(record["conversations"], "conversations"))
        elif "prompt" in record:
            turns = _plain_turns(record)
        else:
            keys = ", ".join(sorted(record)) or "none"
            raise _Invalid(
                f"none of the known shapes: expected 'messages', 'conversations' or 'prompt' "
                f"(keys: {keys})"
            )
        tools = tools_of(record.get("tools"))
    except ConversationError as exc:
        raise _Invalid(str(exc)) from None
    messages, answer = _drop_trailing_answer(turns)
    return messages, answer, None if tools is None else tuple(tools)


def _with_system(record: dict[str, Any], turns: list[Message]) -> list[Message]:
    """ShareGPT's record-level ``system`` (LLaMA-Factory's column) as the first turn."""
    system = record.get("system")
    if system is None or turns[0]["role"] == "system":
        return turns
    if not isinstance(system, str):
        raise _Invalid(f"'system' must be a string, got {json_type(system)}")
    return [{"role": "system", "content": system}, *turns] if system else turns


def _plain_turns(record: dict[str, Any]) -> list[Message]:
    prompt, system = record["prompt"], record.get("system")
    if not isinstance(prompt, str):
        raise _Invalid(f"'prompt' must be a string, got {json_type(prompt)}")
    if system is not None and not isinstance(system, str):
        raise _Invalid(f"'system' must be a string, got {json_type(system)}")
    turns = [{"role": "system", "content": system}] if system else []
    return [*turns, {"role": "user", "content": prompt}]


def _drop_trailing_answer(turns: list[Message]) -> tuple[tuple[Message, ...], Message | None]:
    answer = None
    if turns[-1]["role"] == "assistant":
        answer = turns[-1]
        turns = turns[:-1]
        if not turns:
            raise _Invalid("empty after dropping the trailing assistant turn")
    last = turns[-1]
    if last["role"] not in PROMPT_ENDS:
        raise _Invalid(f"last turn is {last['role']!r}, expected 'user' or 'tool'")
    if last["role"] == "user" and not text_of(last["content"]).strip():
        raise _Invalid("last user turn is empty")
    return tuple(turns), answer


def _record_id(record: dict[str, Any]) -> str | None:
    for key in ID_KEYS:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _Invalid(f"'{key}' must be a string or an integer, got {json_type(value)}")
        text = str(value)
        if not text.strip():
            raise _Invalid(f"empty '{key}'")
        return text
    return None


def _canonical(messages: tuple[Message, ...], tools: tuple[Any, ...] | None) -> bytes:
    # What the template reads: a plain chat's digest (and so its id) is what it was before
    # tools and agent turns were read.
    body: Any = [core(m) for m in messages]
    if tools:
        body = {"messages": body, "tools": list(tools)}
    try:
        text = json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        # A parquet column of a type JSON has not (bytes, a timestamp): the prompt store and
        # the training rows are JSON.
        raise _Invalid(f"a value JSON cannot hold ({exc})") from None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        # JSON escapes like "\ud800" decode to lone surrogates, which no tokenizer can take.
        raise _Invalid("text holds a lone surrogate (a bad \\u escape)") from None


def _content_id(dataset: str, canonical: bytes) -> str:
    return hashlib.sha1(dataset.encode("utf-8") + b"\0" + canonical).hexdigest()[:16]
