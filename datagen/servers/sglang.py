"""SGLang's native API (0.5.23): ``/generate``, ``/abort_request``, ``/server_info``.

    POST /generate {"input_ids": [...], "sampling_params": {...}, "rid": rid, "stream": false}
      -> {"output_ids": [...], "text": ..., "meta_info": {"finish_reason": {...},
          "prompt_tokens": n, "completion_tokens": m, "e2e_latency": s, ...}}
    POST /abort_request {"rid": rid}    (200 even for a rid it does not run)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from datagen.servers.base import (
    INPUT_RESERVE,
    Generation,
    Limits,
    LimitsUnknown,
    Reader,
    ServerKind,
    max_model_len,
    positive,
)


class SGLang(ServerKind):
    name = "sglang"
    generate_path = "/generate"
    abort_path = "/abort_request"
    # /health_generate runs one token, so a stuck server fails it
    health_path = "/health_generate"

    def generate_body(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                      rid: str, logprobs: bool = False,
                      prompt_logprobs: bool = False) -> dict[str, Any]:
        # logprobs are not asked, the prompt's (input_token_logprobs) neither: SGLang 0.5.23
        # returns them after temperature scaling (unless SGLANG_RETURN_ORIGINAL_LOGPROB is
        # set on the server), not the model's own
        return {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "rid": rid, "stream": False}

    def parse_generation(self, data: Any, latency_s: float) -> Generation:
        meta = data["meta_info"]
        output_ids = [int(x) for x in data["output_ids"]]
        return Generation(
            output_ids=output_ids,
            finish_reason=meta.get("finish_reason") or {},
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            latency_s=float(meta.get("e2e_latency", latency_s)),
            text=str(data.get("text", "")),
        )

    def abort_body(self, rid: str) -> dict[str, Any]:
        # SGLang 0.5.23 matches the rid exactly: a prefix aborts nothing
        return {"rid": rid}

    def limits(self, read: Reader, where: str) -> Limits:
        """``/server_info`` ``context_length`` is the launch argument, null unless the
        server was started with ``--context-length``: then ``/v1/models``
        ``data[0].max_model_len`` (the model's own) is the one in force.
        ``max_req_input_len`` (context - 6 in SGLang 0.5.23) is the longest input it takes."""
        try:
            info = read("/server_info")
        except (OSError, ValueError) as exc:
            raise LimitsUnknown(f"cannot read {where}/server_info: {exc}") from exc
        if not isinstance(info, dict):
            raise LimitsUnknown(f"cannot read {where}/server_info: {info!r}")
        context, source = positive(info.get("context_length")), f"{where}/server_info"
        if context is None:
            context, source = max_model_len(read), f"{where}/v1/models max_model_len"
        if context is None:
            raise LimitsUnknown(f"{where}/server_info has no context_length and /v1/models "
                                "no max_model_len")
        max_input = positive(info.get("max_req_input_len"))
        return Limits(context, min(context - 1, max_input or context - INPUT_RESERVE), source)
