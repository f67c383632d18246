"""Generation server kinds: SGLang's native API and vLLM's token-in/token-out API.

``server_kind`` in the settings names one, or ``"auto"``: the kind is then read from the
server once, from ``/v1/models`` (both kinds serve it; vLLM's entries say ``"owned_by":
"vllm"``). Any other answer there, a router's 404 included, means SGLang, the default;
a 5xx is no answer yet (a proxy in front of a server that is down), so nothing is decided.
"""

from __future__ import annotations

from config.settings import SERVER_KINDS
from datagen.servers.base import HTTPStatusError, Reader, ServerKind
from datagen.servers.sglang import SGLang
from datagen.servers.vllm import VLLM

KINDS: dict[str, ServerKind] = {"sglang": SGLang(), "vllm": VLLM()}
assert set(KINDS) | {"auto"} == set(SERVER_KINDS)


def detect(read: Reader) -> ServerKind:
    """The kind of the server ``read`` asks; raises OSError when it does not answer."""
    try:
        models = read("/v1/models")
    except HTTPStatusError as exc:
        if exc.status >= 500:
            raise ConnectionError(str(exc)) from exc
        return KINDS["sglang"]  # no such route: not vLLM's /v1/models
    except ValueError:  # not JSON: not vLLM's /v1/models
        return KINDS["sglang"]
    try:
        owners = {m.get("owned_by") for m in models["data"]}
    except (KeyError, TypeError, AttributeError):
        return KINDS["sglang"]
    return KINDS["vllm"] if "vllm" in owners else KINDS["sglang"]
