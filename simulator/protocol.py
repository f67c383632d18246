"""The /generate request and response bodies, checked the way SGLang 0.5 checks them."""

import logging
import uuid
from dataclasses import dataclass
from http import HTTPStatus

from simulator.config import SimulatorConfig
from simulator.engine import SimRequest
from simulator.errors import ApiError
from simulator.lengths import plan_output, tokenize_text

logger = logging.getLogger(__name__)

# SamplingParams' API fields; anything else makes SGLang refuse the request.
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
})
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


@dataclass(frozen=True)
class GenerateCall:
    items: list[GenerateItem]
    is_batch: bool
    stream: bool


def parse_generate(body: object, config: SimulatorConfig) -> GenerateCall:
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    prompts, is_batch = _prompts(body, config)
    stream = bool(body.get("stream", False))
    if is_batch and stream:
        raise _bad("The simulator does not stream batch requests.")
    rids = _rids(body.get("rid"), len(prompts), is_batch)
    params = _sampling_list(body.get("sampling_params"), len(prompts), is_batch)
    triples = zip(rids, prompts, params, strict=True)
    items = [_item(rid, ids, sp, config) for rid, ids, sp in triples]
    return GenerateCall(items, is_batch, stream)


def build_request(item: GenerateItem, config: SimulatorConfig, stream: bool,
                  dataset: str | None) -> SimRequest:
    plan = plan_output(config, item.input_ids, item.max_new_tokens, item.sampling_seed,
                       item.min_new_tokens, item.ignore_eos)
    return SimRequest(
        rid=item.rid,
        prompt_tokens=len(item.input_ids),
        plan=plan,
        stream=stream,
        stream_interval=item.stream_interval or config.stream_interval,
        dataset=dataset,
    )


def result_body(req: SimRequest, count: int, finish_reason: dict | None,
                e2e_latency: float) -> dict:
    """SGLang's output dict; a stream chunk has the cumulative output and finish_reason None."""
    return {
        "text": req.plan.text_upto(count),
        "output_ids": req.plan.ids[:count],
        "meta_info": {
            "id": req.rid,
            "finish_reason": finish_reason,
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": count,
            "cached_tokens": 0,
            "e2e_latency": e2e_latency,
        },
    }


def _prompts(body: dict, config: SimulatorConfig) -> tuple[list[list[int]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise _bad("Either text or input_ids should be provided, not both.")
    if text is not None:
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
    if is_batch and isinstance(rid, list) and len(rid) == count:
        if all(isinstance(r, str) for r in rid):
            return rid
    raise _bad("The rid should be a string for a single request and a list of strings "
               "of the batch size for a batch request.")


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
    for key in params:
        if key not in SAMPLING_KEYS:
            raise _bad(f"SamplingParams.__init__() got an unexpected keyword argument '{key}'")
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
