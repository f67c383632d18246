"""vLLM's token-in/token-out API (0.32): `/inference/v1/generate` and `.../abort_requests`.

The server needs ``--enable-scale-out`` (or ``--tokens-only``) for these routes; without it
they answer 403 "Scale-out endpoints are disabled", which reaches the dead letters as is.

    POST /inference/v1/generate {"request_id": rid, "token_ids": [...], "stream": false,
                                 "sampling_params": {"max_tokens": n, ...}}
      -> {"request_id": "generate-tokens-<rid>", "usage": {"prompt_tokens": n,
          "completion_tokens": m, ...}, "choices": [{"token_ids": [...],
          "finish_reason": "stop" | "length" | "abort", "stop_reason": id | str | null,
          "logprobs": null | {"content": [{"token_id": id, "logprob": x, ...}, ...]}}]}
    POST /inference/v1/abort_requests {"request_ids": ["generate-tokens-<rid>"]}  (200 always)

vLLM runs the request under ``generate-tokens-<rid>`` (the id the answer names) and an
abort must name that id exactly. Unknown ``sampling_params`` keys are ignored by vLLM without
a word, so SGLang's names are translated here and any other is refused (BadRequest) rather
than silently dropped. ``sampling_params.logprobs`` 0 (``logprobs=True``) answers each sampled
token's log-probability: vLLM's ``logprobs_mode`` default ``raw_logprobs``, the log-softmax of
the model's logits before temperature, penalties or top-p/top-k (the state check compares
the captured final states with them); -9999.0 where vLLM had none. Like SGLang, the stop
token (EOS or a ``stop_token_ids`` match) is the last output id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from datagen.errors import BadRequest
from datagen.servers.base import (
    Generation,
    Limits,
    LimitsUnknown,
    Reader,
    ServerKind,
    max_model_len,
)

REQUEST_ID_PREFIX = "generate-tokens-"  # vLLM 0.32's ServingTokens.serve_tokens
# SGLang's sampling_params names -> vLLM's SamplingParams fields.
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
           "sampling_seed": "seed"}
SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
             "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "n")
ABORT_MESSAGE = "Aborted"  # SGLang's text for an abort; vLLM gives none


def sampling_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params as vLLM's. The text is never used, so vLLM detokenizes only
    where stop strings need it."""
    unknown = sorted(set(params) - set(RENAMED) - set(SAME_NAME))
    if unknown:
        raise BadRequest(f"sampling_params {', '.join(unknown)}: no vLLM equivalent is "
                         f"known here (vLLM ignores keys it does not know); taken: "
                         f"{', '.join(sorted((*RENAMED, *SAME_NAME)))}")
    out = {RENAMED.get(key, key): value for key, value in params.items()}
    out["detokenize"] = bool(params.get("stop"))
    return out


def finish_reason(reason: Any, stop_reason: Any, output_ids: list[int]) -> dict[str, Any]:
    """vLLM's finish_reason and stop_reason in SGLang's shape. stop_reason is null for EOS
    (then the last output id is the EOS that matched), else the stop id or string."""
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    if reason == "stop":
        matched = stop_reason if stop_reason is not None else (
            output_ids[-1] if output_ids else None)
        return {"type": "stop", "matched": matched}
    if reason == "abort":
        return {"type": "abort", "message": ABORT_MESSAGE}
    if not isinstance(reason, str):
        raise ValueError(f"finish_reason {reason!r}")
    # another of vLLM's ("repetition" where repetition_detection is asked): kept as it came
    return {"type": reason, "stop_reason": stop_reason}


def sampled_logprobs(logprobs: Any, output_ids: list[int]) -> tuple[float, ...] | None:
    """``choices[0].logprobs`` as one float per output id; None when not asked. ValueError
    when they do not name the output's ids (a malformed answer)."""
    if logprobs is None:
        return None
    content = logprobs["content"] or []
    if [int(c["token_id"]) for c in content] != output_ids:
        raise ValueError("logprobs.content does not follow the output's token_ids")
    return tuple(float(c["logprob"]) for c in content)


def prompt_id_logprobs(entries: Any) -> tuple[float, ...] | None:
    """The answer's ``prompt_logprobs`` ([null, {"<id>": {"logprob": x, ...}}, ...]: one
    entry per prompt id, the first null) as prompt id j+1's log-probability, j = 0, 1, ...;
    None when not asked. With ``prompt_logprobs`` 0 each entry holds the prompt id itself,
    and a second one when that id was not the top-ranked: the prompt id's is the one taken
    (the dict's first, vLLM puts the prompt id first). ValueError when malformed."""
    if entries is None:
        return None
    if not entries or entries[0] is not None:
        raise ValueError("prompt_logprobs does not start with the first prompt id's null")
    out = []
    for entry in entries[1:]:
        if not isinstance(entry, dict) or not entry:
            raise ValueError("prompt_logprobs holds an entry that is not a token's logprob")
        out.append(float(next(iter(entry.values()))["logprob"]))
    return tuple(out)


class VLLM(ServerKind):
    name = "vllm"
    generate_path = "/inference/v1/generate"
    abort_path = "/inference/v1/abort_requests"
    health_path = "/health"  # 200 while the engine core runs

    def generate_body(self, input_ids: Sequence[int], sampling_params_: Mapping[str, Any],
                      rid: str, logprobs: bool = False,
                      prompt_logprobs: bool = False) -> dict[str, Any]:
        params = sampling_params(sampling_params_)
        if logprobs:
            params["logprobs"] = 0  # the sampled token's only
        if prompt_logprobs:
            params["prompt_logprobs"] = 0  # each prompt id's own only
        return {"request_id": rid, "token_ids": list(input_ids),
                "sampling_params": params, "stream": False}

    def parse_generation(self, data: Any, latency_s: float) -> Generation:
        choice = data["choices"][0]
        output_ids = [int(x) for x in choice["token_ids"]]
        usage = data.get("usage") or {}
        return Generation(
            output_ids=output_ids,
            finish_reason=finish_reason(choice.get("finish_reason"),
                                        choice.get("stop_reason"), output_ids),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", len(output_ids))),
            latency_s=latency_s,
            text="",
            logprobs=sampled_logprobs(choice.get("logprobs"), output_ids),
            prompt_logprobs=prompt_id_logprobs(data.get("prompt_logprobs")),
        )

    def abort_body(self, rid: str) -> dict[str, Any]:
        return {"request_ids": [REQUEST_ID_PREFIX + rid]}

    def limits(self, read: Reader, where: str) -> Limits:
        """``/v1/models`` ``max_model_len``: a prompt of that many tokens or more is refused
        (400, "The decoder prompt (length N) ... is longer than the maximum model length");
        prompt + max_tokens past it is not refused, the answer just ends there (length)."""
        context = max_model_len(read)
        if context is None:
            raise LimitsUnknown(f"cannot read max_model_len from {where}/v1/models")
        return Limits(context, context, f"{where}/v1/models max_model_len")
