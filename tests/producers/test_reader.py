"""Reading prompt datasets: record shapes, bad input, ids, duplicates, discovery, the demo data."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from producers import files, reader
from producers.reader import BadRecord, Prompt, discover_datasets, read_dataset

DEMO = Path(__file__).resolve().parents[2] / "data" / "demo" / "partition"
USER = {"role": "user", "content": "What is the capital of France?"}


def write_lines(path: Path, lines: list[str | bytes | dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    chunks = []
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        chunks.append(line if isinstance(line, bytes) else line.encode("utf-8"))
    path.write_bytes(b"\n".join(chunks) + b"\n")
    return path


def read_all(path: Path, name: str = "B1_test") -> list[Prompt | BadRecord]:
    return list(read_dataset(name, path))


def only_prompt(path: Path) -> Prompt:
    [item] = read_all(path)
    assert isinstance(item, Prompt), item
    return item


# --- record shapes -------------------------------------------------------------------------------


def test_openai_shape_keeps_messages_and_record_id(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"id": "q-1", "messages": [USER]}])
    prompt = only_prompt(path)
    assert prompt.dataset == "B1_test"
    assert prompt.sample_id == "q-1"
    assert prompt.messages == (USER,)
    assert prompt.source == f"{path}:1"


def test_sharegpt_shape_maps_human_and_gpt_roles(tmp_path: Path) -> None:
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
             {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "Tell a joke"}]
    prompt = only_prompt(write_lines(tmp_path / "d.jsonl", [{"conversations": turns}]))
    assert [m["role"] for m in prompt.messages] == ["system", "user", "assistant", "user"]
    assert prompt.messages[-1] == {"role": "user", "content": "Tell a joke"}


def test_sharegpt_system_column_becomes_the_first_turn(tmp_path: Path) -> None:
    # LLaMA-Factory's ShareGPT rows carry the system prompt in a column of its own
    turns = [{"from": "human", "value": "Hi"}]
    prompt = only_prompt(write_lines(tmp_path / "d.jsonl", [
        {"system": "Be brief.", "conversations": turns}]))
    assert prompt.messages == ({"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hi"})


def test_specforge_shape_uses_role_content_conversations(tmp_path: Path) -> None:
    record = {"id": "sf-9", "conversations": [USER]}
    prompt = only_prompt(write_lines(tmp_path / "d.jsonl", [record]))
    assert (prompt.sample_id, prompt.messages) == ("sf-9", (USER,))


def test_plain_prompt_becomes_user_turn_after_optional_system(tmp_path: Path) -> None:
    lines = [{"prompt": "2+2?"}, {"prompt": "3+3?", "system": "S"}]
    path = write_lines(tmp_path / "d.jsonl", lines)
    first, second = read_all(path)
    assert first.messages == ({"role": "user", "content": "2+2?"},)
    assert second.messages == ({"role": "system", "content": "S"},
                               {"role": "user", "content": "3+3?"})


def test_trailing_assistant_turn_is_dropped_and_history_kept(tmp_path: Path) -> None:
    turns = [USER, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "And of Spain?"}, {"role": "assistant", "content": "X"}]
    prompt = only_prompt(write_lines(tmp_path / "d.jsonl", [{"messages": turns}]))
    assert prompt.messages == tuple(turns[:3])


def test_extra_turn_keys_reach_the_template_unchanged(tmp_path: Path) -> None:
    # A template may read them (Kimi's renders a turn's `name` as its role).
    record = {"messages": [{**USER, "name": "bob", "weight": 1}]}
    assert only_prompt(write_lines(tmp_path / "d.jsonl", [record])).messages == (
        {**USER, "name": "bob", "weight": 1},)


# --- bad input ------------------------------------------------------------------------------------

BAD_LINES = [
    ('{"messages": [{"role": "user" "content": "hi"}]}', ["invalid JSON", "delimiter", "col"]),
    ("[1, 2]", ["expected a JSON object", "array"]),
    ('{"text": "hello"}', ["none of the known shapes", "text"]),
    ('{"messages": []}', ["empty 'messages'"]),
    ('{"conversations": []}', ["empty 'conversations'"]),
    ('{"messages": "hi"}', ["'messages' must be a list"]),
    ('{"messages": [{"role": "assistant", "content": "A"}]}', ["empty after dropping"]),
    ('{"messages": [{"role": "user"}]}', ["turn 1", "'role' and 'content'"]),
    ('{"messages": [{"role": "user", "content": ["a"]}]}', ["turn 1", "part 1 is not a text part"]),
    ('{"messages": [{"role": "user", "content": 5}]}', ["turn 1", "string or a list of parts"]),
    ('{"messages": [{"role": "tool", "content": "1"}, {"role": "user", "content": "q"}]}',
     ["turn 1", "a 'tool' turn with no tool call before it"]),
    ('{"messages": [{"role": "wizard", "content": "1"}]}', ["turn 1", "unknown role 'wizard'"]),
    # agent lines: the reason names the turn, the call or the tool
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, '
     '"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{oops"}}]}, '
     '{"role": "tool", "tool_call_id": "c1", "content": "r"}]}',
     ["turn 2: tool call 1 (f): arguments are not JSON"]),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, '
     '"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "5"}}]}, '
     '{"role": "tool", "tool_call_id": "c1", "content": "r"}]}',
     ["turn 2: tool call 1 (f): arguments must be a JSON object, got number"]),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null, '
     '"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {}}}]}, '
     '{"role": "tool", "tool_call_id": "c9", "content": "r"}]}',
     ["turn 3: tool_call_id 'c9' answers no call"]),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}, '
     '{"role": "tool", "content": "r"}]}', ["turn 3: a 'tool' turn with no tool call"]),
    ('{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]}',
     ["tools[1]: not a function spec"]),
    ('{"messages": [{"role": "user", "content": "q"}], "tools": "{not json"}',
     ["'tools' is a string but not JSON"]),
    ('{"messages": [{"role": "user", "content": "q"}], "tools": {"name": "f"}}',
     ["'tools' must be a list of function specs, got object"]),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, '
     '{"type": "image_url", "image_url": {"url": "x.png"}}]}]}',
     ["turn 1: part 2 is 'image_url': media cannot be generated from token ids"]),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}',
     ["turn 2: content is null"]),
    ('{"messages": [{"role": "user", "content": "q", "reasoning_content": "r"}]}',
     ["turn 1: reasoning on a 'user' turn"]),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", '
     '"value": "{bad"}, {"from": "observation", "value": "r"}]}',
     ["turn 2: function_call is not JSON"]),
    ('{"conversations": [{"from": "bing", "value": "q"}]}', ["unknown role 'bing'"]),
    ('{"messages": ["hi"]}', ["turn 1", "expected an object"]),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}',
     ["last turn is 'system'"]),
    ('{"messages": [{"role": "user", "content": "   "}]}', ["last user turn is empty"]),
    ('{"prompt": 5}', ["'prompt' must be a string"]),
    ('{"prompt": "q", "system": 1}', ["'system' must be a string"]),
    ('{"id": "", "prompt": "q"}', ["empty 'id'"]),
    ('{"id": 1.5, "prompt": "q"}', ["'id' must be a string or an integer"]),
    ('{"prompt": "bad \\ud800 escape"}', ["lone surrogate"]),
    (b'{"prompt": "caf\xe9"}', ["not valid UTF-8 at byte 15"]),
]


@pytest.mark.parametrize(("bad_line", "words"), BAD_LINES)
def test_bad_line_is_reported_with_location_and_reading_goes_on(
    tmp_path: Path, bad_line: str | bytes, words: list[str]
) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "before"}, "", bad_line,
                                               {"prompt": "after"}])
    first, bad, last = read_all(path)
    assert isinstance(bad, BadRecord), bad
    assert (bad.dataset, bad.path, bad.line) == ("B1_test", str(path), 3)
    for word in words:
        assert word in bad.reason
    assert str(bad) == f"{path}:3: {bad.reason}"
    assert first.messages[0]["content"] == "before"
    assert last.messages[0]["content"] == "after"
    assert last.source == f"{path}:4"


def test_blank_lines_are_skipped_but_counted(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", ["", "   ", {"prompt": "q"}, "\r"])
    assert only_prompt(path).source == f"{path}:3"


def test_utf8_bom_on_first_line_is_accepted(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [b'\xef\xbb\xbf{"prompt": "q"}'])
    assert only_prompt(path).messages[0]["content"] == "q"


def test_oversized_line_is_reported_without_loading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "MAX_LINE_BYTES", 64)
    big = {"prompt": "x" * 500}
    path = write_lines(tmp_path / "d.jsonl", [big, {"prompt": "short"}])
    bad, good = read_all(path)
    assert isinstance(bad, BadRecord) and "longer than 64 bytes" in bad.reason
    assert good.source == f"{path}:2"


# --- ids and duplicates ---------------------------------------------------------------------------


def test_content_id_is_stable_across_reads_and_depends_on_dataset(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"messages": [USER]}])
    first = only_prompt(path).sample_id
    assert first == read_all(path)[0].sample_id
    assert len(first) == 16 and int(first, 16) >= 0
    assert read_all(path, name="B2_other")[0].sample_id != first


def test_same_messages_in_another_shape_get_the_same_id(tmp_path: Path) -> None:
    a = only_prompt(write_lines(tmp_path / "a.jsonl", [{"prompt": USER["content"]}]))
    b = only_prompt(write_lines(tmp_path / "b.jsonl",
                                [{"conversations": [{"from": "human", "value": USER["content"]}]}]))
    assert a.sample_id == b.sample_id


@pytest.mark.parametrize(("record", "expected"), [
    ({"id": 42}, "42"), ({"sample_id": "s/1"}, "s/1"), ({"uuid": "u-1"}, "u-1"),
    ({"id": None, "uuid": "u-2"}, "u-2"),
])
def test_record_id_wins_over_content_id(tmp_path: Path, record: dict, expected: str) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{**record, "prompt": "q"}])
    assert only_prompt(path).sample_id == expected


def test_duplicates_by_id_or_content_are_reported_and_first_wins(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "ds" / "a.jsonl", [
        {"id": "x", "prompt": "one"},
        {"id": "x", "prompt": "two"},  # same id
        {"id": "y", "prompt": "one"},  # same messages
        {"prompt": "three"},
    ])
    write_lines(tmp_path / "ds" / "b.jsonl", [{"prompt": "three"}])
    items = read_all(tmp_path / "ds")
    assert [type(i).__name__ for i in items] == ["Prompt", "BadRecord", "BadRecord", "Prompt",
                                                 "BadRecord"]
    assert items[0].messages[0]["content"] == "one"
    assert items[1].reason == f"duplicate of {path}:1 (same id)"
    assert items[2].reason == f"duplicate of {path}:1 (same messages)"
    assert items[4].reason.startswith(f"duplicate of {path}:4")
    assert items[4].path == str(tmp_path / "ds" / "b.jsonl")


@pytest.mark.parametrize(("sample_id", "safe"), [
    ("chat-0001", True), ("ns:1.2_a", True), ("../x", False), ("a b", False), ("x" * 129, False),
    ("ok\n", False),
])
def test_is_safe_id_accepts_only_file_and_key_safe_ids(sample_id: str, safe: bool) -> None:
    assert reader.is_safe_id(sample_id) is safe


def test_unsafe_record_id_is_kept_as_data(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"id": "../../etc/passwd", "prompt": "q"}])
    assert only_prompt(path).sample_id == "../../etc/passwd"


def test_duplicates_are_per_dataset(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "q"}])
    assert isinstance(only_prompt(path), Prompt)
    assert isinstance(read_all(path, name="A1_other")[0], Prompt)


# --- folders and streaming ------------------------------------------------------------------------


def test_dataset_folder_reads_jsonl_files_recursively_in_sorted_order(tmp_path: Path) -> None:
    folder = tmp_path / "A1_code"
    write_lines(folder / "b.jsonl", [{"prompt": "b"}])
    write_lines(folder / "a.jsonl", [{"prompt": "a"}])
    write_lines(folder / "sub" / "c.jsonl", [{"prompt": "c"}])
    write_lines(folder / ".hidden" / "d.jsonl", [{"prompt": "d"}])
    (folder / "notes.txt").write_text("not data")
    contents = [p.messages[0]["content"] for p in read_all(folder)]
    assert contents == ["a", "b", "c"]


def test_reading_streams_a_large_file_in_small_memory(tmp_path: Path) -> None:
    # Given a 10 MB file, when the prompts are consumed one by one,
    # then peak memory stays far below the file size.
    filler = "word " * 1000
    path = tmp_path / "big.jsonl"
    with path.open("w") as fh:
        for i in range(2000):
            fh.write(json.dumps({"prompt": f"{i} {filler}"}) + "\n")
    tracemalloc.start()
    try:
        count = sum(1 for item in read_dataset("B1_big", path) if isinstance(item, Prompt))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 2000
    assert peak < path.stat().st_size / 5


# --- discovery ------------------------------------------------------------------------------------


@pytest.fixture
def partition(tmp_path: Path) -> Path:
    write_lines(tmp_path / "B1_chat" / "part-000.jsonl", [{"prompt": "q"}])
    write_lines(tmp_path / "B2_math.jsonl", [{"prompt": "q"}])
    write_lines(tmp_path / "A1_code" / "x" / "y.jsonl", [{"prompt": "q"}])
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / ".cache").mkdir()
    return tmp_path


def test_discover_all_lists_folders_and_files_sorted(partition: Path) -> None:
    assert discover_datasets(partition) == [
        ("A1_code", partition / "A1_code"),
        ("B1_chat", partition / "B1_chat"),
        ("B2_math", partition / "B2_math.jsonl"),
    ]


@pytest.mark.parametrize("selection", ["B2_math, A1_code", ["B2_math", "A1_code", "B2_math"]])
def test_discover_selection_keeps_the_order_asked(partition: Path, selection) -> None:
    assert [name for name, _ in discover_datasets(partition, selection)] == ["B2_math", "A1_code"]


def test_discover_unknown_name_lists_the_available_ones(partition: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset.*B9_nope.*available: A1_code, B1_chat"):
        discover_datasets(partition, "B1_chat,B9_nope")


@pytest.mark.parametrize("name", ["../../etc", "/etc", "a/b", ".hidden", "", " ,", "x y"])
def test_discover_rejects_unsafe_selection_names(partition: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid dataset name|empty dataset selection"):
        discover_datasets(partition, name)


def test_discover_rejects_unsafe_name_in_partition(partition: Path) -> None:
    write_lines(partition / "my data" / "a.jsonl", [{"prompt": "q"}])
    with pytest.raises(ValueError, match="invalid dataset name 'my data'"):
        discover_datasets(partition)


def test_discover_rejects_folder_and_file_with_the_same_name(partition: Path) -> None:
    write_lines(partition / "B1_chat.jsonl", [{"prompt": "q"}])
    with pytest.raises(ValueError, match="'B1_chat' is both"):
        discover_datasets(partition)


def test_discover_missing_partition_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        discover_datasets(tmp_path / "nope")


@pytest.mark.parametrize("name", ["../x", "B1\n", "B1/x", "..", " B1"])
def test_read_dataset_rejects_unsafe_name(tmp_path: Path, name: str) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "q"}])
    with pytest.raises(ValueError, match="invalid dataset name"):
        list(read_dataset(name, path))


# --- the bundled demo partition -------------------------------------------------------------------

DEMO_COUNTS = {  # dataset: (prompts, bad lines, words that must appear in the bad reasons)
    "A1_code": (80, 1, ["empty 'conversations'"]),
    "A2_longdoc": (40, 1, ["empty after dropping the trailing assistant turn"]),
    "B1_chat": (120, 2, ["invalid JSON", "duplicate of"]),
    "B2_math": (100, 1, ["a 'tool' turn with no tool call before it"]),
    "C1_agent": (24, 1, ["tool_call_id 'functions.unknown:7' answers no call"]),
    "C2_think": (16, 1, ["part 2 is 'image_url': media cannot be generated"]),
}


def test_demo_partition_has_the_expected_prompts_and_bad_lines() -> None:
    datasets = discover_datasets(DEMO)
    assert [name for name, _ in datasets] == sorted(DEMO_COUNTS)
    for name, path in datasets:
        items = list(read_dataset(name, path))
        prompts = [i for i in items if isinstance(i, Prompt)]
        bad = [i for i in items if isinstance(i, BadRecord)]
        expected_prompts, expected_bad, reasons = DEMO_COUNTS[name]
        assert (len(prompts), len(bad)) == (expected_prompts, expected_bad), name
        for words in reasons:
            assert any(words in b.reason for b in bad), (name, words, [str(b) for b in bad])


def test_demo_partition_mixes_history_and_trailing_answers() -> None:
    prompts = [p for name, path in discover_datasets(DEMO, "B1_chat")
               for p in read_dataset(name, path) if isinstance(p, Prompt)]
    assert any(len([m for m in p.messages if m["role"] == "user"]) > 1 for p in prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
