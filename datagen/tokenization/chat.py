"""Prompt ids from a conversation, exactly as the configured server renders its chat request.

``ChatEncoder`` renders ``apply_chat_template(messages, tools=tools, add_generation_prompt=True,
**chat_template_kwargs)`` over the conversation up to the turn generated (``datagen.
conversation``'s messages; the last one a user or a tool turn) and tokenizes the text without
adding special tokens, which is what SGLang's and vLLM's `/generate` take. The messages and
tools it hands the template are those the server of ``server_kind`` hands it for the chat
request the conversation makes (``datagen.servers.chat_request``: the server's tool dump,
the fields its message models keep, how it joins text parts), so the ids are those the
served target sees for that request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datagen.conversation import text_of
from datagen.servers.chat_request import RENDERINGS, RequestRefused
from datagen.servers.content_format import CONTENT_FORMATS
from datagen.tokenization.tokenizer import TokenizerError, load_tokenizer

Chat = Sequence[Mapping[str, Any]]
Tools = Sequence[Any] | None

# Stands for a generated assistant turn while the template renders what follows it.
TURN_SENTINEL = "<<datagen:generated-turn>>"
# The markers a thinking model writes around its reasoning; with any string the template
# splits text on, they go into the turn the history check writes back (history_probes).
THINK_MARKERS = ("<think>", "</think>")
SPLIT_METHODS = ("split", "rsplit", "partition", "rpartition")


class ChatTemplateError(ValueError):
    """The chat template refused a conversation; index is its position in a batch, if any."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class HistoryRewritten(ChatTemplateError):
    """The template writes a generated turn into the history otherwise than verbatim, so
    ``regenerate = "all"`` cannot be exact with it, whatever the conversation."""


def _parse(template: str) -> Any:
    import jinja2

    try:
        return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return None


def split_markers(template: str) -> list[str]:
    """The strings a template splits text on (Qwen3's and DeepSeek-R1's ``content.split(
    '</think>')[-1]``, which drops an earlier turn's reasoning)."""
    from jinja2 import nodes

    tree = _parse(template)
    found = [] if tree is None else [
        call.args[0].value for call in tree.find_all(nodes.Call)
        if isinstance(call.node, nodes.Getattr) and call.node.attr in SPLIT_METHODS
        and call.args and isinstance(call.args[0], nodes.Const)
        and isinstance(call.args[0].value, str) and call.args[0].value]
    return list(dict.fromkeys(found))


def history_probes(template: str) -> tuple[dict[str, Any], ...]:
    """A generated assistant turn as a client writes it back into the history, each way it
    may: the model's text whole (the reasoning markers inside it, the whitespace a model may
    put around it), and the server's split (``reasoning_content`` beside the answer). A
    template that renders either otherwise than its generation prompt followed by the
    content verbatim rewrites earlier turns: thinking dropped (a split on ``</think>``, a
    reasoning_content rendered), whitespace trimmed (``| trim``)."""
    markers = [m for m in split_markers(template) if m not in THINK_MARKERS]
    raw = (f"\n{THINK_MARKERS[0]}\nreasoning\n{THINK_MARKERS[1]}\n\n"
           f"{''.join(m + ' ' for m in markers)}{TURN_SENTINEL}\n")
    return ({"role": "assistant", "content": raw},
            {"role": "assistant", "content": f" {TURN_SENTINEL}\n",
             "reasoning_content": "\nreasoning\n"})


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and returns prompt token ids.

    template_kwargs go to the template on every call (e.g. `{"enable_thinking": False}`, or
    Kimi's `{"thinking": False}`). server_kind ("sglang" or "vllm") names the server whose
    rendering of a chat request the prompts follow. Template failures (unknown role, missing
    content) and requests the server refuses raise ChatTemplateError, a ValueError whose
    `.index` names the failing conversation of a batch so the caller can drop it and retry.
    """

    def __init__(
        self, tokenizer_path: str | Path, template_kwargs: Mapping[str, Any] | None = None,
        trust_remote_code: bool = False, server_kind: str = "sglang",
    ) -> None:
        if server_kind not in RENDERINGS:
            raise ValueError(f"server_kind {server_kind!r}: prompts are rendered as one of "
                             f"{', '.join(RENDERINGS)} renders a chat request")
        self._tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
        template = getattr(self._tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default is the one used
            template = template.get("default")
        if not template:
            raise TokenizerError(f"tokenizer_path {tokenizer_path}: the tokenizer has no "
                                 "chat template")
        if self._tokenizer.eos_token_id is None:
            raise TokenizerError(f"tokenizer_path {tokenizer_path}: the tokenizer has no "
                                 "eos token")
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.server_kind = server_kind
        self.template: str = template
        self.content_format = CONTENT_FORMATS[server_kind](template)
        self.history_probes = history_probes(template)
        self.eos_token_id: int = int(self._tokenizer.eos_token_id)
        # len() counts added tokens too, which is what an embedding table must cover.
        self.vocab_size: int = len(self._tokenizer)

    def encode(self, messages: Chat, tools: Tools = None) -> list[int]:
        """Token ids of one conversation followed by the assistant generation prompt."""
        return self.encode_batch([messages], [tools])[0]

    def tokens(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_turns(self, messages: Chat, tools: Tools = None
                     ) -> tuple[list[int], list[list[int]]]:
        """Ids for generating every assistant turn of a conversation, in order
        (``regenerate = "all"``).

        Returns the first turn's prompt (the messages before the first assistant turn, with
        the generation prompt) and, for each later turn, the ids the template writes between
        the turn before it and its generation: that turn's close, the messages up to the next
        assistant turn, the generation prompt. The assistant contents themselves are left
        out (they are generated), so a worker builds each turn's prompt as the previous
        prompt + its exact output ids + these ids. Without assistant turns: (encode, []).

        Refused (ChatTemplateError) where that cannot be exact: a conversation with tool calls
        or results (a regenerated call no longer matches the recorded result), and a template
        that writes a generated turn into the history otherwise than its generation prompt
        followed by the turn verbatim (``HistoryRewritten``; ``history_probes``: a thinking
        template that drops the reasoning of earlier turns, one that trims their text).
        """
        chat = [dict(m) for m in messages]
        if any(TURN_SENTINEL in text_of(m.get("content") or "") for m in chat):
            raise ChatTemplateError(f"a message holds the marker {TURN_SENTINEL!r}")
        if any(m["role"] == "tool" or m.get("tool_calls") for m in chat):
            raise ChatTemplateError("regenerate = 'all' cannot be exact for a conversation "
                                    "with tool calls or results (a regenerated call no longer "
                                    "matches its recorded result); use regenerate = 'each'")
        cuts = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        written_back = [[probe if m["role"] == "assistant" else m for m in chat]
                        for probe in self.history_probes]
        first = self.encode(chat[:cuts[0]] if cuts else chat, tools)
        between = []
        for n, cut in enumerate(cuts):
            end = cuts[n + 1] if n + 1 < len(cuts) else len(chat)
            after = [self._after_turn(history[:end], cut, n + 1, tools)
                     for history in written_back]
            between.append(self.tokens(after[0]))
        return first, between

    def _after_turn(self, history: Chat, cut: int, turn: int, tools: Tools) -> str:
        """What the template writes after the generated turn at ``cut``: the prompt then
        holds that turn's generation prompt and its text verbatim, or the ids a worker
        concatenates are not what the template (and the server) would render."""
        text = self.render(history, tools)
        verbatim = self.render(history[:cut], tools) + history[cut]["content"]
        if not text.startswith(verbatim):
            raise HistoryRewritten(
                f"regenerate = 'all' cannot be exact with this template: it renders assistant "
                f"turn {turn} in the history otherwise than its generation prompt followed by "
                "the turn verbatim (thinking dropped from earlier turns: a split on "
                "</think>, a reasoning_content rendered; text trimmed?); use regenerate = "
                "'each'")
        return text[len(verbatim):]

    def render_conversation(self, messages: Chat, tools: Tools = None) -> str:
        """The whole conversation's text, its last turn included: no generation prompt (what
        a trainer's parser renders)."""
        chat, chat_tools = self.request(messages, tools)
        return self._render_one(chat, chat_tools, generation=False)

    def render(self, messages: Chat, tools: Tools = None) -> str:
        """The prompt text the template produces for one conversation."""
        return self.render_batch([messages], [tools])[0]

    def render_batch(self, conversations: Sequence[Chat],
                     tools: Sequence[Tools] | None = None) -> list[str]:
        if not conversations:
            return []
        chats: list[list[dict[str, Any]]] = []
        tool_lists: list[Tools] = []
        for index, (conversation, given) in enumerate(zip(
                conversations, tools if tools is not None else [None] * len(conversations),
                strict=True)):
            try:
                chat, chat_tools = self.request(conversation, given)
            except RequestRefused as exc:
                raise ChatTemplateError(f"conversation {index}: {exc}", index) from exc
            chats.append(chat)
            tool_lists.append(chat_tools)
        try:
            return self._render(chats, tool_lists)
        except Exception as batch_exc:
            # One bad conversation fails the whole batch; find it so the caller can drop it.
            for index, (chat, chat_tools) in enumerate(zip(chats, tool_lists, strict=True)):
                try:
                    self._render([chat], [chat_tools])
                except Exception as exc:
                    raise _template_error(exc, index) from exc
            raise _template_error(batch_exc) from batch_exc

    def encode_batch(self, conversations: Sequence[Chat],
                     tools: Sequence[Tools] | None = None) -> list[list[int]]:
        """Same ids as `encode` on each conversation, with one batched tokenizer call."""
        texts = self.render_batch(conversations, tools)
        if not texts:
            return []
        # The template already wrote bos and the markers; adding special tokens would double them.
        encoded = self._tokenizer(
            texts,
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return encoded["input_ids"]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def request(self, messages: Chat, tools: Tools = None
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools the server hands the template for this conversation's chat
        request; raises RequestRefused where the server answers it with a 400."""
        return RENDERINGS[self.server_kind](messages, tools, self.template)

    def _render(self, chats: list[list[dict[str, Any]]], tools: list[Tools]) -> list[str]:
        for chat in chats:
            if not chat:
                raise ValueError("empty conversation")
        if all(t is None for t in tools):
            return self._tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=False, **self.template_kwargs)
        # A batch shares one `tools`: conversations with tools render one at a time.
        return [self._render_one(chat, chat_tools) for chat, chat_tools in zip(chats, tools,
                                                                                strict=True)]

    def _render_one(self, chat: list[dict[str, Any]], tools: Tools,
                    generation: bool = True) -> str:
        return self._tokenizer.apply_chat_template(
            chat, tools=list(tools) if tools else None, add_generation_prompt=generation,
            tokenize=False, **self.template_kwargs)


def _template_error(exc: Exception, index: int | None = None) -> ChatTemplateError:
    where = f"conversation {index}: " if index is not None else ""
    return ChatTemplateError(f"{where}chat template failed: {exc}", index)
