"""Write the bundled demo partition (data/demo/partition/); run again to reproduce it byte for byte.

    python data/demo/make_demo.py

Four datasets mixing every record shape the reader accepts, with multi-turn history, trailing
assistant turns to drop, and five deliberately bad lines so the demo shows the bad-input report:

    B1_chat     120 prompts, 2 files, OpenAI + ShareGPT; bad: invalid JSON, a duplicate
    B2_math     100 prompts, 1 file, plain + OpenAI;     bad: a tool turn with no call
    A1_code      80 prompts, 2 files, SpecForge;         bad: empty conversations
    A2_longdoc   40 prompts, 1 file, OpenAI, long documents (1.5K-3K tokens, the `long` queue);
                 bad: nothing left after dropping the trailing assistant turn
    C1_agent     24 prompts, 1 file, agent trajectories: OpenAI with `tools`, `tool_calls`,
                 `tool` results and reasoning, ending on a result, an answer or a pending call,
                 and ShareGPT `function_call`/`observation`; every fourth trajectory with
                 bare-spec tools and calls without ids; bad: an unknown tool_call_id
    C2_think     16 prompts, 1 file, thinking chats (`reasoning_content` on earlier turns), the
                 last user turn in OpenAI text parts; bad: an image part
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "partition"
SEED = 7

TOPICS = ["sourdough bread", "a small vegetable garden", "remote team meetings", "city cycling",
          "learning the piano", "home networking", "saving for retirement", "birdwatching",
          "a first marathon", "moving to a new city", "houseplants", "public speaking",
          "a camping trip", "reading more books", "a job interview", "composting"]
ASKS = ["How should I get started with {t}?", "What are common mistakes people make with {t}?",
        "Can you give me a simple plan for {t} over the next month?",
        "Explain {t} to a friend who has never tried it.",
        "What would you check first if {t} is not going well?"]
FILLER = ("I have tried a few things already but the results were mixed and I am not sure what "
          "to change next. My time is limited during the week, so simple steps help most. ").split()
SYSTEMS = ["You are a helpful assistant.", "Answer briefly and clearly.",
           "You are a patient tutor. Show your reasoning step by step."]
LANGS = ["Python", "Rust", "Go", "TypeScript", "SQL"]
CODE_TASKS = ["parses a CSV file and returns the rows as dictionaries",
              "merges two sorted lists into one sorted list",
              "retries an HTTP request with exponential backoff",
              "counts word frequencies in a text file", "validates an email address",
              "implements a least recently used cache", "finds the longest common prefix"]
SNIPPET = ("def load(path):\n    rows = []\n    for line in open(path):\n"
           "        rows.append(line.split(','))\n    return rows\n")
NAME_PARTS = ["load", "parse", "merge", "count", "check", "build", "fetch", "clean", "sort"]
DOC_WORDS = ("the report describes how the regional water system was planned built and run over "
             "ten years with notes on budget staff training energy use river levels public "
             "meetings and the results of every quarterly review including problems found early "
             "and the changes made after each one").split()


def chat_text(rng: random.Random) -> str:
    ask = rng.choice(ASKS).format(t=rng.choice(TOPICS))
    return ask + " " + " ".join(rng.choice(FILLER) for _ in range(rng.randint(10, 120)))


def answer_text(rng: random.Random) -> str:
    words = (rng.choice(FILLER) for _ in range(rng.randint(8, 40)))
    return "Here is a short answer. " + " ".join(words)


def openai_turns(rng: random.Random, history: int, trailing: bool) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    for _ in range(history):
        turns += [{"role": "user", "content": chat_text(rng)},
                  {"role": "assistant", "content": answer_text(rng)}]
    turns.append({"role": "user", "content": chat_text(rng)})
    if trailing:
        turns.append({"role": "assistant", "content": answer_text(rng)})
    return turns


def sharegpt(turns: list[dict[str, str]]) -> dict[str, Any]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in turns]}


def b1_chat(rng: random.Random) -> tuple[list[str], list[str]]:
    rows = []
    for i in range(120):
        turns = openai_turns(rng, history=rng.choice([0, 0, 1, 2]), trailing=i % 3 == 0)
        rows.append(sharegpt(turns) if i % 2 else {"id": f"chat-{i:04d}", "messages": turns})
    first, second = [dump(r) for r in rows[:70]], [dump(r) for r in rows[70:]]
    first.insert(33, '{"messages": [{"role": "user" "content": "Name a good book."}]}')
    second.insert(20, first[5])  # the same record again: reported as a duplicate
    return first, second


def b2_math(rng: random.Random) -> list[str]:
    rows = []
    for i in range(100):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
        text = (f"A shop sells {a} boxes on Monday and {b} boxes on Tuesday. Each box holds {c} "
                f"items. How many items were sold in total? Explain each step.")
        if i % 4 == 0:
            rows.append({"messages": [{"role": "system", "content": SYSTEMS[2]},
                                      {"role": "user", "content": text}]})
        else:
            rows.append({"prompt": text, **({"system": SYSTEMS[2]} if i % 5 == 0 else {})})
    lines = [dump(r) for r in rows]
    lines.insert(50, dump({"messages": [{"role": "tool", "content": "42"},
                                        {"role": "user", "content": "What is 6 x 7?"}]}))
    return lines


def a1_code(rng: random.Random) -> tuple[list[str], list[str]]:
    rows = []
    for i in range(80):
        lang, task = rng.choice(LANGS), rng.choice(CODE_TASKS)
        name = f"{rng.choice(NAME_PARTS)}_{rng.choice(NAME_PARTS)}_{i}"
        ask = (f"Write a {lang} function `{name}` that {task}. It must handle inputs of up to "
               f"{rng.randint(10, 10_000)} items. Add tests and explain the edge cases.")
        if i % 4 == 1:
            ask = f"Review this code and rewrite it in {lang}:\n```python\n{SNIPPET}```\n" + ask
        turns = [{"role": "user", "content": ask}]
        if i % 5 == 2:
            turns.append({"role": "assistant", "content": f"Here is a {lang} version."})
        rows.append({"id": f"code-{i:03d}", "conversations": turns})
    first, second = [dump(r) for r in rows[:40]], [dump(r) for r in rows[40:]]
    second.insert(10, dump({"id": "code-empty", "conversations": []}))
    return first, second


def long_document(rng: random.Random) -> str:
    paragraphs = []
    for number in range(rng.randint(10, 14)):
        words = [rng.choice(DOC_WORDS) for _ in range(rng.randint(80, 110))]
        paragraphs.append(f"Section {number + 1}. " + " ".join(words).capitalize() + ".")
    return "\n\n".join(paragraphs)


def a2_longdoc(rng: random.Random) -> list[str]:
    lines = []
    for i in range(40):
        ask = rng.choice(["Summarize the document above in five bullet points.",
                          "List every problem the document mentions and how it was fixed."])
        turns = [{"role": "system", "content": SYSTEMS[1]},
                 {"role": "user", "content": long_document(rng) + "\n\n" + ask}]
        lines.append(dump({"id": f"doc-{i:02d}", "messages": turns}))
    lines.insert(25, dump({"id": "doc-answer-only",
                           "messages": [{"role": "assistant", "content": "Nothing to ask."}]}))
    return lines


AGENT_TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one test file",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"}}}}}]
FILES = ["setup.py", "src/app/cache.py", "src/app/cli.py", "tests/test_cache.py", "README.md"]
BUGS = ["the cache never expires entries", "the CLI ignores the --verbose flag",
        "a test fails on an empty input", "the build fails after the last upgrade"]


def agent_turns(rng: random.Random, i: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the tools to inspect the "
                                      "repository before you answer."},
        {"role": "user", "content": f"Please find out why {rng.choice(BUGS)}."}]
    for step in range(rng.randint(1, 3)):
        name = rng.choice(["read_file", "run_tests"])
        args = {"path": rng.choice(FILES)} if name == "read_file" else {"target": "tests/"}
        # every fourth trajectory carries no ids (the reader gives Kimi's own)
        ids = {"id": f"functions.{name}:{step}"} if i % 4 != 3 else {}
        turns.append({"role": "assistant", "content": None,
                      "reasoning_content": f"Step {step + 1}: check with {name}.",
                      "tool_calls": [{**ids, "type": "function", "function": {
                          "name": name, "arguments": json.dumps(args)}}]})
        result = (f"{rng.randint(3, 40)} passed, {rng.randint(0, 2)} failed"
                  if name == "run_tests" else f"def handler():\n    return {rng.randint(1, 9)}")
        answers = {"tool_call_id": ids["id"]} if ids else {}
        turns.append({"role": "tool", **answers, "name": name, "content": result})
    if i % 3 == 1:
        turns.append({"role": "assistant", "content": "The handler returns a constant.",
                      "reasoning_content": "The results show it."})
    elif i % 3 == 2:
        turns.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": "functions.run_tests:9", "type": "function",
            "function": {"name": "run_tests", "arguments": {"target": "tests/"}}}]})
    return turns


def sharegpt_agent(path: str) -> dict[str, Any]:
    return {"tools": json.dumps([t["function"] for t in AGENT_TOOLS]), "conversations": [
        {"from": "human", "value": f"What does {path} do?"},
        {"from": "function_call", "value": json.dumps({"name": "read_file",
                                                       "arguments": {"path": path}})},
        {"from": "observation", "value": f"# {path}\nimport os\n"}]}


def c1_agent(rng: random.Random) -> list[str]:
    # the trajectories without ids also declare their tools as bare function specs (glaive's)
    rows = [{"id": f"traj-{i:02d}", "tools": AGENT_TOOLS if i % 4 != 3 else
             [t["function"] for t in AGENT_TOOLS], "messages": agent_turns(rng, i)}
            for i in range(20)]
    rows += [{"id": f"glaive-{i}", **sharegpt_agent(FILES[i])} for i in range(4)]
    lines = [dump(r) for r in rows]
    bad = agent_turns(rng, 0)
    bad[3] = {**bad[3], "tool_call_id": "functions.unknown:7"}
    lines.insert(12, dump({"id": "traj-bad", "tools": AGENT_TOOLS, "messages": bad}))
    return lines


def c2_think(rng: random.Random) -> list[str]:
    lines = []
    for i in range(16):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        lines.append(dump({"id": f"think-{i:02d}", "messages": [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": str(a + b),
             "reasoning_content": f"{a} plus {b} is {a + b}."},
            {"role": "user", "content": [{"type": "text", "text": "Now multiply them."},
                                         {"type": "text", "text": "Show the steps."}]}]}))
    lines.insert(8, dump({"id": "think-image", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "file:///tmp/cat.png"}}]}]}))
    return lines


def dump(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False)


def write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main() -> None:
    rng = random.Random(SEED)
    chat_a, chat_b = b1_chat(rng)
    write(OUT / "B1_chat" / "part-000.jsonl", chat_a)
    write(OUT / "B1_chat" / "part-001.jsonl", chat_b)
    write(OUT / "B2_math" / "problems.jsonl", b2_math(rng))
    code_a, code_b = a1_code(rng)
    write(OUT / "A1_code" / "part-000.jsonl", code_a)
    write(OUT / "A1_code" / "part-001.jsonl", code_b)
    write(OUT / "A2_longdoc" / "documents.jsonl", a2_longdoc(rng))
    rng = random.Random(SEED + 1)  # the four datasets above stay byte for byte what they were
    write(OUT / "C1_agent" / "trajectories.jsonl", c1_agent(rng))
    write(OUT / "C2_think" / "chats.jsonl", c2_think(rng))


if __name__ == "__main__":
    main()
