"""Agent and thinking conversations, exactly as the target's template serves them.

The reader's every shape, the prompt ids against the template called directly (a Kimi-style
custom-code template that renders tools, calls, results and thinking as Kimi-K2.5's does, and a
plain one), regenerate = "each" through real workers (a kill and a restart included), and the
text rows against SpecForge's own parser.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Stack, wait_until, write_jsonl

from datagen.builders.tiktoken_fixture import build_tiktoken_tokenizer
from datagen.generation.follower import follow
from datagen.generation.merge import merge_dataset
from datagen.generation.records import iter_records, records_dir
from datagen.servers.content_format import sglang_content_format, vllm_content_format
from datagen.tokenization.chat import ChatEncoder
from datagen.training.text_rows import TextRows
from datagen.training.training_set import prepare
from producers.producer import Producer
from producers.reader import BadRecord, Prompt, read_dataset

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
CALL = {"id": "functions.read_file:0", "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "setup.py"}'}}
AGENT = {"id": "traj-1", "tools": TOOLS, "messages": [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Why does the build fail?"},
    {"role": "assistant", "content": None, "reasoning_content": "Look at setup.py first.",
     "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.read_file:0", "name": "read_file",
     "content": "from setuptools import setup"},
    {"role": "assistant", "content": "It imports setuptools but never calls setup().",
     "reasoning": "The file is one import."}]}
THINKING = {"id": "think-1", "messages": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3?"},
                                 {"type": "text", "text": "Be brief."}]}]}


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiktoken_tokenizer(tmp_path_factory.mktemp("kimi") / "tok")


@pytest.fixture(scope="module")
def kimi(kimi_dir: Path) -> ChatEncoder:
    return ChatEncoder(kimi_dir, {"thinking": True}, trust_remote_code=True)


def read(tmp_path: Path, *lines: Any) -> list[Prompt | BadRecord]:
    return list(read_dataset("C1", write_jsonl(tmp_path / "C1.jsonl", list(lines))))


# --- every shape agent data comes in -------------------------------------------------------

def test_an_openai_agent_line_becomes_the_conversation_the_template_reads(tmp_path):
    (prompt,) = read(tmp_path, AGENT)
    assert prompt.tools == tuple(TOOLS)
    system, user, call, result = prompt.messages
    # arguments given as a JSON string reach the template as the object (as SGLang and vLLM
    # pass them), null content as "", and the call keeps its id and type
    assert call == {"role": "assistant", "content": "", "reasoning_content":
                    "Look at setup.py first.", "tool_calls": [
                        {**CALL, "function": {"name": "read_file",
                                              "arguments": {"path": "setup.py"}}}]}
    assert result == AGENT["messages"][3]  # name and tool_call_id unchanged
    # the trailing answer, its `reasoning` spelling read as reasoning_content, is the turn
    # generated
    assert prompt.answer == {"role": "assistant", "content": AGENT["messages"][4]["content"],
                             "reasoning_content": "The file is one import."}


def test_tools_as_a_json_string_and_specforge_conversations_read_alike(tmp_path):
    specforge = {"id": "traj-1", "tools": json.dumps(TOOLS),
                 "conversations": AGENT["messages"]}
    (a,), (b,) = read(tmp_path, AGENT), read(tmp_path / "b", specforge)
    assert (a.messages, a.tools, a.answer) == (b.messages, b.tools, b.answer)


def test_sharegpt_tool_roles_become_calls_and_results(tmp_path):
    line = {"tools": json.dumps([TOOLS[0]["function"]]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps(
            {"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "18C, sunny"},
        {"from": "gpt", "value": "It is 18C and sunny."}]}
    (prompt,) = read(tmp_path, line)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "tool"]
    # no ids in the row: the call gets Kimi's own (what live traffic carries), the result
    # the id of the call it answers
    assert prompt.messages[1]["tool_calls"] == [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}, "id": "functions.get_weather:0"}]
    assert prompt.messages[2] == {"role": "tool", "content": "18C, sunny",
                                  "tool_call_id": "functions.get_weather:0"}
    assert prompt.tools == (TOOLS[0]["function"],)


def test_a_conversation_ending_on_a_pending_call_generates_that_call(tmp_path):
    (prompt,) = read(tmp_path, {"tools": TOOLS, "messages": AGENT["messages"][:3]})
    assert prompt.messages[-1]["role"] == "user" and prompt.answer["tool_calls"]


def test_a_plain_chat_keeps_its_sample_id(tmp_path):
    # Ids of records without one digest what the template reads: unchanged for plain chats
    # since the agent fields were added (the value was computed before them).
    (prompt,) = read(tmp_path, {"messages": [{"role": "user", "content": "hello"}]})
    assert prompt.sample_id == "4a0daf0a9a569cd4"  # ee2e37a gave this id


# --- the prompt ids are the template's, called directly -------------------------------------

def test_agent_prompt_ids_are_apply_chat_template_with_tools(tmp_path, kimi):
    (prompt,) = read(tmp_path, AGENT)
    direct = kimi._tokenizer.apply_chat_template(
        list(prompt.messages), tools=list(prompt.tools), add_generation_prompt=True,
        tokenize=True, return_dict=False, thinking=True)
    assert kimi.encode(prompt.messages, prompt.tools) == list(direct)
    text = kimi.render(prompt.messages, prompt.tools)
    # Kimi's layout: the declarations first, the call between section markers, the result as
    # its own turn named by the tool, and the prompt's last turn a tool result, so the turn
    # after the last user turn keeps its reasoning
    # the tokenizer's own code declares the tools TypeScript style (Kimi-K2.5's)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\n"
                           "namespace functions {\n// Read a file\ntype read_file = (_: {\n"
                           "  path?: string\n}) => any;\n}\n<|im_end|>")
    assert ("<|im_assistant|>assistant<|im_middle|><think>Look at setup.py first.</think>"
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0"
            '<|tool_call_argument_begin|>{"path": "setup.py"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>") in text
    assert text.endswith("<|im_system|>read_file<|im_middle|>## Return of functions.read_file:0"
                         "\nfrom setuptools import setup<|im_end|>"
                         "<|im_assistant|>assistant<|im_middle|><think>")


def test_thinking_of_turns_before_the_last_user_turn_is_dropped_by_the_template(tmp_path, kimi):
    (prompt,) = read(tmp_path, THINKING)
    text = kimi.render(prompt.messages)
    assert "Add them." not in text and "<|im_middle|><think></think>4<|im_end|>" in text
    # the Kimi-style template loops over parts: they reach it as parts
    assert kimi.content_format == "openai"
    assert "<|im_user|>user<|im_middle|>And 3+3?Be brief.<|im_end|>" in text


def test_a_plain_template_gets_the_text_parts_joined_as_sglang_joins_them(tmp_path, encoder):
    (prompt,) = read(tmp_path, THINKING)
    assert encoder.content_format == "string"
    assert "user<|header_end|>\n\nAnd 3+3? Be brief.<|eot|>" in encoder.render(prompt.messages)
    (agent,) = read(tmp_path / "b", AGENT)
    text = encoder.render(agent.messages, agent.tools)
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}' in text
    assert "<|header_start|>tool<|header_end|>\n\nfrom setuptools import setup<|eot|>" in text


def test_content_format_is_detected_as_each_server_detects_it():
    for detect in (sglang_content_format, vllm_content_format):
        assert detect("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
        assert detect("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}"
                      "{% endfor %}{% endfor %}") == "openai"
        assert detect("{% for m in messages %}{% for p in m.content %}{% endfor %}"
                      "{% endfor %}") == "openai"
    # SGLang takes any template naming a medium for one that loops over parts; vLLM looks
    # for the loop, also through a macro that is passed a message's content
    assert sglang_content_format("{{ messages[0]['content'] }}{# image #}") == "openai"
    assert vllm_content_format("{{ messages[0]['content'] }}{# image #}") == "string"
    macro = ("{% macro parts(c) %}{% for p in c %}{{ p['text'] }}{% endfor %}{% endmacro %}"
             "{% for message in messages %}{{ parts(message['content']) }}{% endfor %}")
    assert (sglang_content_format(macro), vllm_content_format(macro)) == ("string", "openai")


# --- regenerate = "each": one sample per assistant turn ------------------------------------

def test_each_assistant_turn_is_a_sample_cut_before_it(tmp_path):
    (prompt,) = read(tmp_path, AGENT)
    events = prompt.events()
    assert [e.sample_id for e in events] == ["traj-1:1", "traj-1:2"]
    assert [len(e.messages) for e in events] == [2, 4]
    assert [e.messages[-1]["role"] for e in events] == ["user", "tool"]
    assert events[0].answer["tool_calls"] and events[1].answer["content"].startswith("It")
    (ending_on_a_result,) = read(tmp_path / "b", {"tools": TOOLS,
                                                  "messages": AGENT["messages"][:4]})
    assert [len(e.messages) for e in ending_on_a_result.events()] == [2, 4]


def generated(encoder: ChatEncoder, history: list[dict[str, Any]], tools: Any,
              turn: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of a turn the target wrote exactly as its template would."""
    prompt = encoder.encode(history, tools)
    whole = encoder.tokens(encoder.render_conversation([*history, turn], tools))
    assert whole[:len(prompt)] == prompt
    return prompt, whole[len(prompt):]


def test_a_well_formed_generated_call_is_parsed_back_exactly(tmp_path, kimi):
    (prompt,) = read(tmp_path, AGENT)
    event = prompt.events()[0]
    turn = {"role": "assistant", "content": "Checking.", "reasoning_content": "Read it.",
            "tool_calls": [{"id": "functions.read_file:0", "type": "function",
                            "function": {"name": "read_file", "arguments": {"path": "a"}}}]}
    ids, out = generated(kimi, list(event.messages), TOOLS, turn)
    rows = TextRows(kimi)
    record = {"id": event.sample_id, "messages": list(event.messages), "tools": TOOLS,
              "prompt_ids": ids, "output_ids": out}
    row = json.loads(rows.line(record))
    assert (rows.exact, rows.inexact) == (1, 0)
    assert row["conversations"][-1] == turn and row["tools"] == TOOLS
    # a turn cut short (no close, no end of the call section) cannot be: written as text
    rows.line({**record, "output_ids": out[:-3]})
    assert (rows.exact, rows.inexact) == (1, 1)


def test_specforge_s_own_parser_renders_the_text_row_to_the_same_ids(tmp_path, kimi):
    # SpecForge (PyPI 0.2.0) with its kimi-k2-thinking template reads the text row: the same
    # ids as the pre-tokenized row, and with train_only_last_turn the loss on the generated
    # turn only, plus the <think> that opened it (the generation prompt's last token).
    from specforge.data.parse import ThinkingParser
    from specforge.data.template import TEMPLATE_REGISTRY

    (prompt,) = read(tmp_path, AGENT)
    event = prompt.events()[1]
    turn = {"role": "assistant", "content": "It never calls setup().",
            "reasoning_content": "One import only."}
    ids, out = generated(kimi, list(event.messages), TOOLS, turn)
    row = json.loads(TextRows(kimi).line({"id": "x", "messages": list(event.messages),
                                          "tools": TOOLS, "prompt_ids": ids,
                                          "output_ids": out}))
    parser = ThinkingParser(kimi._tokenizer, TEMPLATE_REGISTRY.get("kimi-k2-thinking"))
    input_ids, loss_mask = parser.parse(row["conversations"], 4096, train_only_last_turn=True,
                                        tool=row["tools"])
    assert input_ids.tolist() == ids + out
    think = kimi._tokenizer.special_tokens["<think>"]
    assert ids[-1] == think
    assert loss_mask.tolist() == [0] * (len(ids) - 1) + [1] * (len(out) + 1)


# --- through real workers ------------------------------------------------------------------

@pytest.fixture
def kimi_stack(tmp_path: Path, redis_url: str, kimi_dir: Path) -> Any:
    s = Stack(tmp_path, redis_url, kimi_dir, ChatEncoder(kimi_dir, trust_remote_code=True))
    try:
        yield s
    finally:
        s.stop()


def agent_lines(n: int) -> list[dict[str, Any]]:
    lines = []
    for i in range(n):
        call = {**CALL, "id": f"functions.read_file:{i}"}
        messages = [*AGENT["messages"][:2], {**AGENT["messages"][2], "tool_calls": [call]},
                    {**AGENT["messages"][3], "tool_call_id": call["id"],
                     "content": f"line {i}"}, AGENT["messages"][4]]
        lines.append({"id": f"t{i}", "tools": TOOLS, "messages": messages})
    return lines


def each_run(stack: Stack, lines: list[dict[str, Any]], decode_step_s: str,
             **settings: Any) -> Any:
    """Dataset C1 of ``lines`` with regenerate = "each", on a simulator stopping on Kimi's
    <|im_end|>: the settings (no worker started)."""
    stack.start_simulator("--lengths", "uniform:20:40", "--decode-step-s", decode_step_s)
    write_jsonl(stack.tmp / "partition" / "C1.jsonl", lines)
    return stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=4,
                           short_max_tokens=64, trust_remote_code=True, regenerate="each",
                           **settings)


def test_each_turn_runs_as_its_own_sample_through_a_kill_and_a_restart(kimi_stack: Stack):
    # Given: 10 agent trajectories of two assistant turns each, regenerate = "each", and a
    # worker to be killed while it holds requests
    stack = kimi_stack
    settings = each_run(stack, agent_lines(10), "0.02")
    victim = stack.worker("short", name="victim@%h")
    stack.wait_workers(1)
    ledger = stack.ledger()
    (report,) = Producer(settings, stack.app(), ledger).run()
    assert (report.conversations, report.read, report.enqueued) == (10, 20, 20)

    # When: the worker is killed with requests in flight, another takes over
    wait_until(lambda: len(ledger.in_flight("C1")) >= 2, 60, what="requests in flight")
    victim.kill()
    stack.worker("short", name="survivor@%h")
    follow(ledger, 0.3, app=stack.app(), timeout_s=180)

    # Then: every turn of every trajectory is stored once and counted once, its prompt the
    # template's rendering of the history before that turn, tools declared
    merged = merge_dataset(settings.output_dir, "C1", ledger.committed("C1"))
    records = [json.loads(x) for x in Path(merged.path).read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"t{i}:{n}" for i in range(10)
                                                      for n in (1, 2))
    assert ledger.snapshot("C1")["tokens"] == sum(r["trainable_tokens"] for r in records)
    by_id = {line["id"]: line for line in agent_lines(10)}
    for rec in records:
        line, n = by_id[rec["id"].split(":")[0]], int(rec["id"].split(":")[1])
        history = line["messages"][:2 if n == 1 else 4]
        direct = stack.encoder._tokenizer.apply_chat_template(
            [dict(m, content=m["content"] or "") for m in json.loads(json.dumps(history))],
            tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert rec["prompt_ids"] == list(direct)
        assert rec["prompt_ids"] == stack.encoder.encode(rec["messages"], rec["tools"])
        assert rec["tools"] == TOOLS and rec["messages"][-1]["role"] == (
            "user" if n == 1 else "tool")

    # And: prepare's pre-tokenized rows train exactly the generated turn (reasoning, text
    # and calls), never the recorded history; the text rows carry the tools
    tset = prepare(settings, {"C1": ledger.committed("C1")}, lambda: TextRows(stack.encoder))
    rows = [json.loads(x) for x in Path(tset.online_rows).read_text().splitlines()]
    assert len(rows) == 20
    for row in rows:
        rec = next(r for r in records if r["id"] == row["id"])
        assert row["input_ids"] == rec["prompt_ids"] + rec["output_ids"]
        assert row["loss_mask"] == [0] * len(rec["prompt_ids"]) + [1] * len(rec["output_ids"])
    texts = [json.loads(x) for x in Path(tset.conversations).read_text().splitlines()]
    assert all(t["tools"] == TOOLS for t in texts) and len(texts) == 20

    # And: a restart enqueues nothing: every turn is done
    started = time.time()
    (again,) = Producer(settings, stack.app(), ledger).run()
    assert (again.read, again.already_done, again.enqueued) == (20, 20, 0)
    assert not [e for e in stack.sim_log() if e["event"] == "start" and e["time"] > started]
    assert len(list(iter_records(records_dir(settings.output_dir, "C1")))) >= 20


def test_a_budget_closes_a_dataset_of_turns_and_no_turn_starts_after(kimi_stack: Stack):
    # Given: 40 trajectories' 80 turns, a budget of about 15 of them
    stack = kimi_stack
    settings = each_run(stack, agent_lines(40), "0.005", budgets={"C1": 450},
                        token_budget=10**6)
    stack.worker("short")
    stack.wait_workers(1)

    # When: the run goes until the dataset closes
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=180)

    # Then: closed at its budget, the turns done counted once, none started after the close
    snap = ledger.snapshot("C1")
    assert snap["closed"] == "budget" and snap["pending"] == 0
    assert 450 <= snap["tokens"] and snap["stats"]["samples"] < 80
    merged = merge_dataset(settings.output_dir, "C1", ledger.committed("C1"))
    records = [json.loads(x) for x in Path(merged.path).read_text().splitlines()]
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in records)
    closed_at = min(e["t"] for e in ledger.events("C1") if e["e"].startswith("closed"))
    assert not [e for e in stack.sim_log() if e["event"] == "start" and e["time"] > closed_at]
    # ... and a restart skips it: nothing enqueued
    (again,) = Producer(settings, stack.app(), ledger).run()
    assert again.enqueued == 0 and "budget" in again.skipped
