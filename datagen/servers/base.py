"""What a generation server answers, whatever its kind, and what each kind must say.

The client (``datagen/client.py``) owns the transport: connections, timeouts, retries, the
router fallbacks. A server kind owns the wire format: which paths, what a request body
holds, how an answer reads as a ``Generation``, how the limits are read. Token ids go in and
come out as they are on every kind (no text round trip).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# SGLang 0.5.23: max_req_input_len = min(context - 1, KV-cache tokens - 1) - 5, i.e.
# context - 6 where the server does not say.
INPUT_RESERVE = 6

# GET a path of the server, its JSON answer; raises OSError when nothing answers (requests'
# errors are OSErrors), HTTPStatusError or another ValueError for an answer that is not JSON.
Reader = Callable[[str], Any]


class HTTPStatusError(ValueError):
    """The server answered with an HTTP error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """What a server accepts: an input of fewer than ``max_input_tokens`` tokens (SGLang's
    ``max_req_input_len``; more is a 400), and input + max_new_tokens of at most
    ``context_length``."""

    context_length: int
    max_input_tokens: int
    source: str  # where the context length was read, for messages

    def room(self, prompt_tokens: int) -> int:
        """The most new tokens a prompt may ask for; < 1: the server refuses it. One less
        than SGLang takes (it refuses only prompt + max_new_tokens > context)."""
        if prompt_tokens >= self.max_input_tokens:
            return 0
        return self.context_length - prompt_tokens - 1

    def refusal(self, prompt_tokens: int) -> str:
        """Why the server refuses a prompt of this length ("" when it does not)."""
        if self.context_length - prompt_tokens - 1 < 1:
            return (f"prompt has {prompt_tokens} tokens; the context length "
                    f"{self.context_length} leaves no room for a response")
        if prompt_tokens >= self.max_input_tokens:
            return (f"prompt has {prompt_tokens} tokens; the server takes inputs of fewer than "
                    f"{self.max_input_tokens} (max_req_input_len; context length "
                    f"{self.context_length})")
        return ""


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    # SGLang's shape on every kind: {"type": "stop", "matched": id}, {"type": "length",
    # "length": n} or {"type": "abort", "message": text}
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    text: str
    # the sampled tokens' log-probabilities, one per output id, where they were asked for
    # (``logprobs=True``) and the kind gives the model's own (vLLM's raw_logprobs)
    logprobs: tuple[float, ...] | None = None
    # prompt id j+1's log-probability given the ids before it, j = 0 .. n_prompt - 2 (the
    # first prompt id has none), where asked (``prompt_logprobs=True``) and the kind gives them
    prompt_logprobs: tuple[float, ...] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


class LimitsUnknown(LookupError):
    """The server's limits could not be read; the message says where and why."""


class ServerKind(ABC):
    """One kind of generation server: its paths and bodies."""

    name: str
    generate_path: str
    abort_path: str
    health_path: str  # 200 while the server can generate

    @abstractmethod
    def generate_body(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                      rid: str, logprobs: bool = False,
                      prompt_logprobs: bool = False) -> dict[str, Any]:
        """The body of one non-streamed generate call; ``sampling_params`` are SGLang's
        names (the settings' ``sampling_params`` plus ``max_new_tokens``). ``logprobs``: ask
        for the sampled tokens' log-probabilities before any sampling transform, where the
        kind can give them (a kind that cannot asks for nothing); ``prompt_logprobs``: the
        same of the prompt's ids. Raises BadRequest for a parameter this kind cannot take."""

    @abstractmethod
    def parse_generation(self, data: Any, latency_s: float) -> Generation:
        """A 200 answer as a Generation; KeyError, TypeError or ValueError when malformed.
        ``latency_s`` is the client's own measure, for kinds that do not say."""

    @abstractmethod
    def abort_body(self, rid: str) -> dict[str, Any]:
        """The body that aborts exactly the request sent with ``rid``."""

    @abstractmethod
    def limits(self, read: Reader, where: str) -> Limits:
        """The limits in force on the server at ``where`` (its masked URL, for messages);
        raises LimitsUnknown."""


def positive(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def max_model_len(read: Reader) -> int | None:
    """``/v1/models`` ``data[0].max_model_len`` (SGLang and vLLM both serve it)."""
    try:
        return positive(read("/v1/models")["data"][0].get("max_model_len"))
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
