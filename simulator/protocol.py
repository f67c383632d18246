"""The /generate request and response bodies, checked the way SGLang 0.5 checks them."""

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus

from simulator.config import SimulatorConfig
from simulator.contract import check_contract
from simulator.engine import WAITING_ABORT_REASON, SimRequest
from simulator.errors import ApiError
from simulator.lengths import plan_output, tokenize_text

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class GenerateItem:
    """One prompt of a /generate call after validation."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    ignore_eos: bool
    sampling_seed: int | None
    stream_interval: int | None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerateCall:
    items: list[GenerateItem]
    is_batch: bool
    stream: bool


def parse_generate(body: object, config: SimulatorConfig) -> GenerateCall:
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    check_contract(body)
    prompts, is_batch = _prompts(body, config)
    stream = bool(body.get("stream", False))
    if is_batch and stream:
        raise _bad("The simulator does not stream batch requests.")
    rids = _rids(body.get("rid"), len(prompts), is_batch)
    _check_unique(rids)
    params = _sampling_list(body.get("sampling_params"), len(prompts), is_batch)
    triples = zip(rids, prompts, params, strict=True)
    items = [_item(rid, ids, sp, config) for rid, ids, sp in triples]
    return GenerateCall(items, is_batch, stream)


def build_request(item: GenerateItem, config: SimulatorConfig, stream: bool,
                  dataset: str | None) -> SimRequest:
    plan = plan_output(config, item.input_ids, scheduled_max_new_tokens(item, config),
                       item.sampling_seed, item.min_new_tokens, item.ignore_eos,
                       item.stop_token_ids)
    return SimRequest(
        rid=item.rid,
        prompt_tokens=len(item.input_ids),
        plan=plan,
        stream=stream,
        stream_interval=item.stream_interval or config.stream_interval,
        dataset=dataset,
    )


def scheduled_max_new_tokens(item: GenerateItem, config: SimulatorConfig) -> int:
    """max_new_tokens as SGLang's scheduler lowers it, silently, to fit the request:
    ``min(max_new_tokens, max_req_len - input - 1)`` with max_req_len = max_req_input_len + 5
    (context - 1 unless the KV pool is smaller). So input + max_new_tokens = context is
    accepted but ends at context - input - 2 tokens, finish_reason length (measured on
    SGLang 0.5.23: 4080 + 16 at context 4096 made 14)."""
    room = config.max_req_input_len + 5 - len(item.input_ids) - 1
    return max(0, min(item.max_new_tokens, room))


def result_body(req: SimRequest, count: int, finish_reason: dict | None,
                e2e_latency: float, streamed: bool = False, first: bool = False) -> dict:
    """SGLang 0.5.23's output dict, with its meta_info keys in its order.

    A stream chunk has the cumulative output and finish_reason None; only the finished
    answer carries ``weight_versions`` and ``e2e_latency``, and ``response_sent_to_client_ts``
    is on a whole answer and on a stream's first chunk only (as measured on the real server).
    No prefix cache is modelled: ``cached_tokens`` 0, and SGLang's details are then null.
    A request aborted before it left the waiting queue never ran: SGLang's tokenizer manager
    answers it alone, with fewer keys and no output (``waiting_abort_body``).
    """
    if finish_reason == WAITING_ABORT_REASON:
        return waiting_abort_body(req, e2e_latency)
    meta: dict = {
        "id": req.rid,
        "finish_reason": finish_reason,
        "prompt_tokens": req.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": count,
        "cached_tokens": 0,
    }
    if finish_reason is not None:
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": count}]
    meta["cached_tokens_details"] = None
    meta["dp_rank"] = None
    if finish_reason is not None:
        meta["e2e_latency"] = e2e_latency
    if not streamed or (first and finish_reason is None):
        meta["response_sent_to_client_ts"] = time.time()
    return {"text": req.plan.text_upto(count), "output_ids": req.plan.ids[:count],
            "meta_info": meta}


def waiting_abort_body(req: SimRequest, e2e_latency: float) -> dict:
    """SGLang 0.5.23's answer, streamed or not, for a request aborted in its waiting queue
    (seen on the real server: an abort that reached the scheduler beside the request)."""
    return {"text": "", "output_ids": [], "meta_info": {
        "id": req.rid, "finish_reason": WAITING_ABORT_REASON, "weight_version": "default",
        "e2e_latency": e2e_latency,
        "weight_versions": [{"version": "default", "start": 0, "end": 0}],
        "completion_tokens": 0, "response_sent_to_client_ts": time.time()}}


def _prompts(body: dict, config: SimulatorConfig) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise _bad("Either text, input_ids or input_embeds should be provided.")
    if input_ids is not None and not input_ids and isinstance(input_ids, list):
        raise _bad("input_ids cannot be empty.")
    # Given both, SGLang serves input_ids (text is not tokenized).
    if input_ids is None:
        if isinstance(text, str):
            return [tokenize_text(text, config)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tokenize_text(t, config) for t in text], True
        raise _bad("text must be a string or a non-empty list of strings.")
    if isinstance(input_ids, list) and input_ids and all(isinstance(x, list) for x in input_ids):
        return [_check_ids(ids, config) for ids in input_ids], True
    return [_check_ids(input_ids, config)], False


def _check_ids(ids: object, config: SimulatorConfig) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise _bad("input_ids must be a non-empty list of token ids.")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
        raise _bad("input_ids must contain non-negative integers only.")
    if max(ids) >= config.vocab_size:
        raise _bad(f"The input_ids {ids} contains values greater than the vocab size "
                   f"({config.vocab_size}).")
    return ids


def _rids(rid: object, count: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if not is_batch and isinstance(rid, str):
        return [rid]
    if is_batch and isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)]  # SGLang's names for a batch's items
    if is_batch and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) == count:
            return rid
        raise _bad("The specified rids length mismatch with the batch_size for batch "
                   "processing.")
    raise _bad("The rid should be a string or a list of strings.")


def _check_unique(rids: list[str]) -> None:
    duplicates = [rid for rid, n in Counter(rids).items() if n > 1]
    if duplicates:
        raise _bad(f"Duplicate request IDs detected within the request: {duplicates}")


def _sampling_list(params: object, count: int, is_batch: bool) -> list[dict]:
    if params is None:
        return [{}] * count
    if isinstance(params, dict):
        return [params] * count
    if is_batch and isinstance(params, list) and len(params) == count:
        if all(isinstance(p, dict) for p in params):
            return params
    raise _bad("sampling_params must be an object, or a list of objects for a batch.")


def _item(rid: str, ids: list[int], params: dict, config: SimulatorConfig) -> GenerateItem:
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    min_new = params.get("min_new_tokens") or 0
    _check_values(params, max_new, min_new)
    _check_context(len(ids), max_new, config)
    if max_new is None:
        # SGLang lets an unset limit run to the end of the context.
        max_new = config.context_len - len(ids) - 1
    return GenerateItem(
        rid=rid,
        input_ids=ids,
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        ignore_eos=bool(params.get("ignore_eos") or False),
        sampling_seed=params.get("sampling_seed"),
        stream_interval=params.get("stream_interval"),
        stop_token_ids=tuple(params.get("stop_token_ids") or ()),
    )


def _check_values(params: dict, max_new: object, min_new: object) -> None:
    # The subset of SamplingParams.verify() whose values change what the simulator does.
    if max_new is not None and (not _is_int(max_new) or max_new < 0):
        raise _bad(f"max_new_tokens must be at least 0, got {max_new}.")
    if not _is_int(min_new) or min_new < 0 or (max_new is not None and min_new > max_new):
        raise _bad(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    temperature = params.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or temperature < 0):
        raise _bad(f"temperature must be a non-negative finite number, got {temperature}.")
    n = params.get("n")
    if n not in (None, 1):
        raise _bad(f"The simulator supports n=1 only, got n={n}.")
    seed = params.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise _bad(f"sampling_seed must be an integer, got {seed!r}.")
    interval = params.get("stream_interval")
    if interval is not None and (not _is_int(interval) or interval < 1):
        raise _bad(f"stream_interval must be a positive integer, got {interval!r}.")


def _check_context(prompt_len: int, max_new: int | None, config: SimulatorConfig) -> None:
    # SGLang 0.5.23, in this order: TokenizerManager._validate_one_request (input >= the
    # context; input + max_new_tokens > the context), then the scheduler's
    # validate_input_length (input >= max_req_input_len, which is context - 6 or less).
    context = config.context_len
    if prompt_len >= context:
        raise _bad(f"The input ({prompt_len} tokens) is longer than the model's context "
                   f"length ({context} tokens).")
    if max_new is not None and prompt_len + max_new > context:
        raise _bad(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {prompt_len + max_new} tokens: {prompt_len} "
            f"tokens from the input messages and {max_new} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )
    limit = config.max_req_input_len
    if prompt_len >= limit:
        raise _bad(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                   f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message)
