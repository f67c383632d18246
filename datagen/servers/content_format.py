"""Whether a server hands a template a message's content as parts or as one string.

Each server reads the template once and decides: "openai" (content reaches the template as a
list of ``{"type": "text", "text"}`` parts, which the template loops over) or "string" (the
parts are joined first). The two servers read different things, so one template may get
parts from SGLang and a string from vLLM (Kimi-K2.5's does: it loops over its parts inside a
macro that takes the whole message).

SGLang 0.5.23 (``parser/jinja_template_utils.py`` ``detect_jinja_template_content_format``):
"openai" when the template names a medium ("image", "audio", "video", "vision" anywhere in
its text), or a ``for`` loop iterates over ``message``'s, ``msg``'s or ``m``'s ``content``.

vLLM 0.32 (``renderers/hf.py`` ``_detect_content_format``): "openai" when a ``for`` loop
iterates over the ``content`` of a message variable (a loop variable over ``messages`` or a
name set from it), over a macro parameter some call passes a message's ``content`` to, or, out
of every macro, over a variable named ``content``. A template that does not parse is "string"
for both.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

from jinja2 import nodes

MEDIA_WORDS = ("image", "audio", "video", "vision")
SGLANG_MESSAGE_NAMES = ("message", "msg", "m")


def parse(template: str) -> nodes.Template | None:
    """The template's syntax tree, parsed as transformers compiles chat templates."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        return _compile_jinja_template(template).environment.parse(template)
    except Exception:  # both servers fall back to "string" on a template they cannot parse
        return None


def accesses(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or ``name[key]`` / ``name.key``), through filters, tests and
    slices."""
    while True:
        if isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Test):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return (accesses(node.node, name) and isinstance(node.arg, nodes.Const)
                and node.arg.value == key)
    return isinstance(node, nodes.Getattr) and accesses(node.node, name) and node.attr == key


@lru_cache(maxsize=16)
def sglang_content_format(template: str) -> str:
    if any(word in template for word in MEDIA_WORDS):
        return "openai"
    tree = parse(template)
    if tree is None:
        return "string"
    for loop in tree.find_all(nodes.For):
        if any(accesses(loop.iter, name, "content") for name in SGLANG_MESSAGE_NAMES):
            return "openai"
    return "string"


@lru_cache(maxsize=16)
def vllm_content_format(template: str) -> str:
    tree = parse(template)
    if tree is None:
        return "string"
    try:
        return "openai" if next(_part_loops(tree), None) is not None else "string"
    except Exception:  # vLLM's detection falls back to "string" where it fails
        return "string"


def _aliases(tree: nodes.Template, name: str) -> list[str]:
    """``name`` and every variable set from it, directly or through another such one."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if accesses(assign.node, current):
                alias = assign.target.name  # an alias set otherwise than to a name fails
                found.append(alias)
                if alias != current:
                    queue.append(alias)
    return found


def _message_names(tree: nodes.Template) -> list[str]:
    lists = _aliases(tree, "messages")
    return [loop.target.name for loop in tree.find_all(nodes.For)
            if any(accesses(loop.iter, name) for name in lists)]


def _content_params(tree: nodes.Template, messages: list[str]) -> dict[int, set[str]]:
    """For each loop inside a macro, the macro's parameters that some call of it passes a
    message's ``content`` to."""
    by_loop: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        params: set[str] = set()
        names = {arg.name for arg in macro.args}
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for arg, param in zip(call.args, macro.args, strict=False):
                if any(accesses(arg, name, "content") for name in messages):
                    params.add(param.name)
            params.update(kw.key for kw in call.kwargs if kw.key in names
                          and any(accesses(kw.value, name, "content") for name in messages))
        for loop in macro.find_all(nodes.For):
            by_loop[id(loop)] = params
    return by_loop


def _part_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    messages = _message_names(tree)
    in_macros = _content_params(tree, messages)
    for loop in tree.find_all(nodes.For):
        if any(accesses(loop.iter, name, "content") for name in messages):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in in_macros.get(id(loop), ())
                or (id(loop) not in in_macros and loop.iter.name == "content")):
            yield loop


CONTENT_FORMATS = {"sglang": sglang_content_format, "vllm": vllm_content_format}
