"""Multi-turn pieces on their own: the template's ids between turns, the turn loop's stops."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from datagen.builders.tiktoken_fixture import build_tiktoken_tokenizer
from datagen.client import Generation
from datagen.generation.job import Job, Prompt
from datagen.generation.turns import Conversation, Stopped, generate_turns
from datagen.tokenization.chat import (
    ChatEncoder,
    ChatTemplateError,
    HistoryRewritten,
    split_markers,
)

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a budget?"},
        {"role": "assistant", "content": "old answer one"},
        {"role": "user", "content": "And a lease?"},
        {"role": "assistant", "content": "old answer two"},
        {"role": "user", "content": "Thanks. Last question: a ledger?"}]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> ChatEncoder:
    folder = build_tiktoken_tokenizer(tmp_path_factory.mktemp("kimi") / "tok")
    return ChatEncoder(folder, {"thinking": False}, trust_remote_code=True)


def test_turn_ids_rebuild_exactly_what_the_template_writes_for_the_generated_history(
        kimi: ChatEncoder) -> None:
    # Given: two generated answers (after the prompt's <think></think>), each ending on the
    # template's close of a turn
    generated = ["A budget is a token count.", "A lease is a deadline."]
    outputs = [kimi._tokenizer(g, add_special_tokens=False)["input_ids"] + [kimi.eos_token_id]
               for g in generated]
    # When: the prompts are built from the turn ids as a worker builds them
    first, between = kimi.encode_turns(CHAT)
    assert len(between) == 2 and all(b[0] == kimi.eos_token_id for b in between)
    ids = first + outputs[0] + between[0][1:] + outputs[1] + between[1][1:]
    # Then: they are the template's rendering of the conversation with the generated answers
    # (which writes an earlier turn as <think></think> and its text, the thinking-off prompt)
    history = [dict(m) for m in CHAT]
    history[2]["content"], history[4]["content"] = generated
    assert ids == kimi.encode(history)
    assert first == kimi.encode(CHAT[:2])


def test_all_is_refused_where_the_template_drops_earlier_turns_thinking(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Kimi-K2.5 with thinking on: the generation prompt ends on <think>, while an earlier turn
    # is rendered <think></think> + its text, so its generated reasoning would be in the ids
    # of the next context where the served target never sees it.
    folder = build_tiktoken_tokenizer(tmp_path_factory.mktemp("kimi-think") / "tok")
    thinking = ChatEncoder(folder, {"thinking": True}, trust_remote_code=True)
    with pytest.raises(ChatTemplateError, match="renders assistant turn 1 in the history"):
        thinking.encode_turns(CHAT)
    assert thinking.encode_turns(CHAT[:2]) == (thinking.encode(CHAT[:2]), [])


# Templates in the shape of the published ones, for the history check of regenerate = "all".
# Qwen3's (Qwen/Qwen3-8B tokenizer_config.json): an assistant turn's text after '</think>' only,
# its reasoning kept only after the last user turn.
QWEN3 = """{%- set ns = namespace(last_query_index=messages|length - 1) -%}
{%- for message in messages[::-1] -%}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 -%}
{%- set ns.last_query_index = messages|length - 1 - loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = message.content -%}
{%- set reasoning_content = '' -%}
{%- if message.reasoning_content is defined and message.reasoning_content is not none -%}
{%- set reasoning_content = message.reasoning_content -%}
{%- elif '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n')
    .split('<think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query_index and reasoning_content -%}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n'
    + content.lstrip('\n') -}}
{%- else -%}{{- '<|im_start|>assistant\n' + content -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""
# DeepSeek-R1's first published template: every assistant turn cut to its text after
# '</think>', the generation prompt a bare assistant marker.
DEEPSEEK_R1 = """{{- bos_token -}}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{{- '<｜User｜>' + message['content'] -}}
{%- elif message['role'] == 'assistant' -%}
{%- set content = message['content'] -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1] -%}{%- endif -%}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"""
# Llama-3's: every turn's text trimmed.
TRIMMED = """{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'
    + message['content'] | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"""
# Every turn written as it is.
VERBATIM = """{%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def with_template(tokenizer_dir: Path, folder: Path, template: str) -> ChatEncoder:
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return ChatEncoder(folder)


@pytest.mark.parametrize("template", [QWEN3, DEEPSEEK_R1, TRIMMED],
                         ids=["qwen3-split-think", "deepseek-r1-split-think", "trim"])
def test_all_is_refused_for_a_template_that_rewrites_earlier_turns(
        tokenizer_dir: Path, tmp_path: Path, template: str) -> None:
    # Given: a template that cuts an earlier turn's text at '</think>' or trims it, so the
    # generated reasoning (or whitespace) a worker would carry into the next turn's prompt
    # is what the template, and the server, take out
    encoder = with_template(tokenizer_dir, tmp_path / "tok", template)
    # When/Then: regenerate = "all" is refused, naming the setting and the way out
    with pytest.raises(HistoryRewritten, match="regenerate = 'all' cannot be exact .* turn 1 "
                       "in the history.* use regenerate = 'each'"):
        encoder.encode_turns(CHAT)


def test_all_is_accepted_for_a_template_that_keeps_earlier_turns_verbatim(
        tokenizer_dir: Path, tmp_path: Path) -> None:
    # Given: a template that writes every turn as it is
    encoder = with_template(tokenizer_dir, tmp_path / "tok", VERBATIM)
    # When: generated answers (reasoning and whitespace included) are put between the ids
    generated = ["<think>\nsome thought\n</think>\n\nA budget is a count. ", "\nA deadline."]
    first, between = encoder.encode_turns(CHAT)
    ids = first
    for answer, after in zip(generated, between, strict=True):
        ids = ids + encoder.tokens(answer) + after
    # Then: they are the template's rendering of the conversation with those answers
    history = [dict(m) for m in CHAT]
    history[2]["content"], history[4]["content"] = generated
    assert encoder.decode(ids) == encoder.render(history)


def test_a_template_splitting_on_its_own_reasoning_marker_is_refused_too(
        tokenizer_dir: Path, tmp_path: Path) -> None:
    # Given: Qwen3's shape with another model's marker: the strings it splits on are found
    other = QWEN3.replace("</think>", "</seed:think>")
    assert split_markers(other) == ["</seed:think>", "<think>"]
    assert split_markers(DEEPSEEK_R1) == ["</think>"] and split_markers(VERBATIM) == []
    # Then: the written-back turn carries that marker too, and the template is refused
    with pytest.raises(HistoryRewritten):
        with_template(tokenizer_dir, tmp_path / "tok", other).encode_turns(CHAT)


def test_all_is_refused_for_a_conversation_with_tool_calls(kimi: ChatEncoder) -> None:
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": {}}}]}
    agent = [*CHAT[:2], call, {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    with pytest.raises(ChatTemplateError, match="tool calls or results"):
        kimi.encode_turns(agent)


def test_a_conversation_without_assistant_turns_is_one_turn(kimi: ChatEncoder) -> None:
    assert kimi.encode_turns(CHAT[:2]) == (kimi.encode(CHAT[:2]), [])


def test_a_conversation_that_starts_with_an_assistant_turn_is_refused(kimi: ChatEncoder) -> None:
    with pytest.raises(ChatTemplateError):
        kimi.encode_turns([{"role": "assistant", "content": "hi"}, *CHAT[1:2]])


def test_task_messages_of_earlier_versions_are_single_turn() -> None:
    old = {"dataset": "B1", "sample": "s1", "queue": "short", "prompt_file": "p", "offset": 0,
           "prompt_tokens": 10, "max_new_tokens": 64, "epoch": 2}
    job = Job.from_payload(old)
    assert (job.turns, job.context_length, job.sample_cap) == (1, 0, 64)
    assert job.max_input_tokens == 0 and job.limits is None
    multi = Job("B1", "s1", "short", "p", 0, 10, 64, 2, turns=3, context_length=500,
                max_input_tokens=494)
    assert Job.from_payload(multi.payload()) == multi and multi.sample_cap == 192


class FakeClient:
    """Answers each turn with `length` ids ending in eos (2), or cut at max_new_tokens."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.calls: list[tuple[list[int], int, str]] = []

    def generate(self, ids: list[int], params: dict[str, Any], rid: str,
                 dataset: str | None = None) -> Generation:
        self.calls.append((list(ids), params["max_new_tokens"], rid))
        if self.length > params["max_new_tokens"]:
            out, reason = [7] * params["max_new_tokens"], {"type": "length"}
        else:
            out, reason = [7] * (self.length - 1) + [2], {"type": "stop", "matched": 2}
        return Generation(out, reason, len(ids), len(out), 0.1, "")


def job_and_prompt(context_length: int, turns: int = 3, max_input_tokens: int = 0
                   ) -> tuple[Job, Prompt]:
    job = Job("B1", "s1", "short", "p", 0, 4, 10, turns=turns, context_length=context_length,
              max_input_tokens=max_input_tokens)
    return job, Prompt("s1", "B1", [], [1, 5, 5, 6], [[2, 3, 6]] * (turns - 1))


def test_each_turn_extends_the_previous_prompt_and_is_clamped_to_the_context() -> None:
    client = FakeClient(length=5)
    job, prompt = job_and_prompt(context_length=23, max_input_tokens=19)
    result = generate_turns(client, job, prompt, "rid", {}, True, lambda: "ok")  # type: ignore[arg-type]
    assert isinstance(result, Conversation)
    (p1, m1, r1), (p2, m2, r2), (p3, m3, r3) = client.calls
    # One rid for every turn: an abort by the ledger entry's exact rid reaches any of them
    assert (r1, r2, r3) == ("rid", "rid", "rid")
    assert p2 == p1 + [7, 7, 7, 7, 2] + [3, 6]  # the close (eos) is written once
    assert (len(p1), len(p2), len(p3)) == (4, 11, 18)
    assert (m1, m2, m3) == (10, 10, 23 - 18 - 1)  # the last turn has 4 tokens of room left
    assert [t["span"] for t in result.turns] == [[4, 9], [11, 16], [18, 22]]
    gen = result.as_generation()
    assert (gen.completion_tokens, gen.prompt_tokens) == (5 + 5 + 4, 22 - 14)
    assert gen.truncated and result.prompt_ids == p3


def test_a_truncated_turn_keeps_the_templates_close() -> None:
    client = FakeClient(length=50)
    job, prompt = job_and_prompt(context_length=0, turns=2)
    generate_turns(client, job, prompt, "rid", {}, True, lambda: "ok")  # type: ignore[arg-type]
    assert client.calls[1][0] == [1, 5, 5, 6] + [7] * 10 + [2, 3, 6]


def test_no_room_left_or_a_refusal_stops_before_the_next_turn() -> None:
    job, prompt = job_and_prompt(context_length=12)  # the second turn has no room
    stop = generate_turns(FakeClient(5), job, prompt, "rid", {}, True, lambda: "ok")  # type: ignore[arg-type]
    assert isinstance(stop, Stopped) and stop.reason == "context" and stop.tokens == 5
    job, prompt = job_and_prompt(context_length=0)
    stop = generate_turns(FakeClient(5), job, prompt, "rid", {}, True, lambda: "closed")  # type: ignore[arg-type]
    assert isinstance(stop, Stopped) and (stop.reason, stop.tokens) == ("closed", 5)
    stop = generate_turns(FakeClient(50), job, prompt, "rid", {}, False, lambda: "ok")  # type: ignore[arg-type]
    assert isinstance(stop, Stopped) and stop.reason == "truncated"


def test_a_turn_the_server_would_refuse_for_its_input_length_is_not_sent() -> None:
    # Given: room in the context for the third turn (18 + 1 < 23), but the server's
    # max_req_input_len (18) refuses an input of 18 tokens
    client = FakeClient(length=5)
    job, prompt = job_and_prompt(context_length=23, max_input_tokens=18)
    stop = generate_turns(client, job, prompt, "rid", {}, True, lambda: "ok")  # type: ignore[arg-type]
    # Then: two turns were sent, the third stopped with the reason
    assert len(client.calls) == 2
    assert isinstance(stop, Stopped) and stop.reason == "context" and stop.tokens == 10
    assert "turn 3 of 3" in stop.detail and "18 tokens" in stop.detail
    assert "max_req_input_len" in stop.detail
    # ... and without the server's figure, context - 6 stands in for it
    client = FakeClient(length=5)
    job, prompt = job_and_prompt(context_length=23)
    assert isinstance(generate_turns(client, job, prompt, "rid", {}, True, lambda: "ok"),  # type: ignore[arg-type]
                      Stopped) and len(client.calls) == 2


def test_fixture_folder_is_built_offline(tmp_path: Path) -> None:
    assert (build_tiktoken_tokenizer(tmp_path / "t") / "tiktoken.model").stat().st_size > 0
