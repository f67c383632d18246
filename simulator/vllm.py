"""vLLM 0.32's token-in/token-out API (``--kind vllm``), as far as the pipeline uses it.

    POST /inference/v1/generate        {"request_id", "token_ids", "sampling_params", "stream"}
    POST /inference/v1/abort_requests  {"request_ids": ["generate-tokens-<request_id>", ...]}
    GET  /v1/models, /health, /version

Measured on a real vLLM 0.32 (CPU build, ``--enable-scale-out --skip-tokenizer-init``) and
held side by side with it in tests/real_vllm/test_simulator_matches_vllm.py: vLLM runs a
request as ``generate-tokens-<request_id>`` and aborts only that exact id; unknown
sampling_params keys are ignored; a prompt of ``max_model_len`` tokens or more is refused,
while prompt + max_tokens past it is cut there (finish_reason length); an abort answers 200
with the tokens made so far and finish_reason ``abort``. The engine and its output plans are
the SGLang mode's; only the bodies differ.
"""

import json
import logging
import uuid
from http import HTTPStatus
from typing import Any

from simulator.app import App
from simulator.config import SimulatorConfig
from simulator.engine import SimRequest
from simulator.errors import ApiError
from simulator.generate import DATASET_HEADER, Responder, reject, suffer_early_fault
from simulator.lengths import plan_output
from simulator.protocol import GenerateItem

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
REQUEST_ID_PREFIX = "generate-tokens-"


class VLLMError(ApiError):
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None,
                 kind: str = "BadRequestError", status: int = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(status, message)
        self.param, self.kind = param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def _validation(kind: str, field: str, msg: str, shown: str, extra: str = "") -> VLLMError:
    """FastAPI's one-error text, as vLLM 0.32 words it."""
    return VLLMError(f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{field}', "
                     f"'msg': '{msg}', 'input': '{shown}'{extra}}}",
                     param=f"body.{field}", kind="Bad Request")


def parse(body: object, config: SimulatorConfig) -> GenerateItem:
    """One request; raises VLLMError where vLLM answers 400."""
    if not isinstance(body, dict):
        raise VLLMError("The request body must be a JSON object.", kind="Bad Request")
    ids = body.get("token_ids")
    if not isinstance(ids, list):
        raise _validation("missing", "token_ids", "Field required",
                          f"<dict of {len(body)} items>")
    if not ids:
        raise _validation("too_short", "token_ids",
                          "List should have at least 1 item after validation, not 0",
                          "<list of 0 items>", ", 'ctx': {'field_type': 'List', "
                          "'min_length': 1, 'actual_length': 0}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x for x in ids):
        raise VLLMError("token_ids must not contain negative values", kind="Bad Request")
    if max(ids) >= config.vocab_size:
        # vLLM without a tokenizer does not check: its engine core dies (see NOT_EMULATED)
        raise VLLMError(f"token id {max(ids)} is out of vocabulary")
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise _validation("missing", "sampling_params", "Field required",
                          f"<dict of {len(body)} items>")
    rid = body.get("request_id")
    return _item(rid if isinstance(rid, str) else _random_id(), ids, params, config)


def _item(rid: str, ids: list[int], params: dict, config: SimulatorConfig) -> GenerateItem:
    _check_prompt(len(ids), config.context_len)
    room = config.context_len - len(ids)
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise VLLMError(f"max_tokens must be at least 1, got {max_tokens}. "
                        f"(parameter=max_tokens, value={max_tokens})", param="max_tokens")
    temperature = params.get("temperature")
    if temperature is not None and temperature < 0:
        raise VLLMError(f"temperature must be non-negative, got {float(temperature)}. "
                        f"(parameter=temperature, value={float(temperature)})",
                        param="temperature")
    min_tokens = params.get("min_tokens") or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise VLLMError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                        f"got {min_tokens}.")
    if params.get("n", 1) != 1:
        raise VLLMError(f"The simulator supports n=1 only, got n={params.get('n')}.")
    # No check of prompt + max_tokens: vLLM ends the answer at max_model_len (length).
    return GenerateItem(rid=rid, input_ids=ids,
                        max_new_tokens=min(max_tokens or room, room), min_new_tokens=min_tokens,
                        ignore_eos=bool(params.get("ignore_eos") or False),
                        sampling_seed=params.get("seed"), stream_interval=None,
                        stop_token_ids=tuple(params.get("stop_token_ids") or ()))


def _check_prompt(length: int, max_model_len: int) -> None:
    # vLLM 0.32 InputProcessor._validate_prompt_len
    if length > max_model_len:
        raise VLLMError(f"The decoder prompt (length {length}) is longer than the maximum "
                        f"model length of {max_model_len}. Make sure that `max_model_len` is "
                        "no smaller than the number of text tokens.")
    if length == max_model_len:
        raise VLLMError(f"The decoder prompt (length {length}) plus the number of requested "
                        "output tokens (at least 1) is longer than the maximum model length "
                        f"of {max_model_len}. Make sure that `max_model_len` is no smaller "
                        "than the number of text tokens (prompt + requested output tokens).")


def _random_id() -> str:
    return uuid.uuid4().hex[:16]


def finish(reason: dict, eos_token_id: int) -> tuple[str, int | str | None]:
    """The engine's (SGLang-shaped) finish reason as vLLM's finish_reason and stop_reason:
    stop_reason is null for EOS, the id for a stop_token_ids match."""
    if reason["type"] == "stop":
        matched = reason.get("matched")
        return "stop", None if matched == eos_token_id else matched
    return reason["type"], None  # "length" or "abort"


def logprobs_body(ids: list[int], asked: object) -> dict | None:
    """``choices[0].logprobs`` for ``sampling_params.logprobs`` (None: not asked): one entry
    per output id, ``top_logprobs`` holding the sampled token alone, as vLLM answers 0 (what
    the pipeline asks; more is not emulated). No model here: made-up values below 0."""
    if asked is None:
        return None
    content = []
    for i, token in enumerate(ids):
        entry = {"token_id": token, "logprob": made_up_logprob(token, i), "rank": 1}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


def made_up_logprob(token: int, position: int) -> float:
    """No model here: a value below 0 that depends on the token and its position."""
    return -0.5 - (token % 7) / 10 - (position % 3) / 100


def prompt_logprobs_body(prompt: list[int], asked: object) -> list | None:
    """The answer's ``prompt_logprobs`` for ``sampling_params.prompt_logprobs`` (None: not
    asked): null for the first prompt id, then each id's own entry keyed by the id, as vLLM
    answers 0 (what the pipeline asks; more is not emulated)."""
    if asked is None:
        return None
    return [None, *({str(token): {"logprob": made_up_logprob(token, i), "rank": 1,
                                  "decoded_token": None}}
                    for i, token in enumerate(prompt[1:], 1))]


def result_body(req: SimRequest, config: SimulatorConfig, logprobs: object = None,
                prompt_logprobs: object = None, prompt: list[int] | None = None) -> dict:
    count = req.decoded
    reason, stop_reason = finish(req.finish_reason or {"type": "abort"}, config.eos_token_id)
    return {
        "request_id": REQUEST_ID_PREFIX + req.rid, "model": config.model_path,
        "created": int(req.created_at),
        "usage": {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + count,
                  "completion_tokens": count, "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "prompt_logprobs": prompt_logprobs_body(prompt or [], prompt_logprobs),
        "prompt_token_id_logprobs": None, "prompt_token_ids": None,
        "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
        "ec_transfer_params": None, "output_mode": "tokens",
        "choices": [{"index": 0, "finish_reason": reason, "stop_reason": stop_reason,
                     "token_ids": req.plan.ids[:count], "routed_experts": None,
                     "sampling_mask": None,
                     "weight_versions": [{"version": "default", "start": 0, "end": count}],
                     "logprobs": logprobs_body(req.plan.ids[:count], logprobs)}],
    }


def handle_generate(out: Responder, app: App, raw: bytes) -> None:
    dataset = out.headers.get(DATASET_HEADER)  # type: ignore[attr-defined]
    try:
        payload: Any = json.loads(raw or b"null")
    except ValueError as exc:
        reject(out, app, VLLMError(f"JSON decode error: {exc}", kind="Bad Request"), None,
                dataset)
        return
    rid_hint = payload.get("request_id") if isinstance(payload, dict) else None
    fault = app.fault.take()
    if fault is not None and suffer_early_fault(out, app, fault, rid_hint, dataset):
        return
    try:
        if isinstance(payload, dict) and payload.get("stream"):
            raise VLLMError("The simulator does not stream the vLLM API.")
        item = parse(payload, app.config)
        plan = plan_output(app.config, item.input_ids, item.max_new_tokens,
                           item.sampling_seed, item.min_new_tokens, item.ignore_eos,
                           item.stop_token_ids)
        req = SimRequest(rid=item.rid, prompt_tokens=len(item.input_ids), plan=plan,
                         dataset=dataset)
        app.engine.submit([req])
    except ApiError as err:
        reject(out, app, err, rid_hint, dataset)
        return
    req.done.wait()  # the engine stops by finishing every request
    asked = payload["sampling_params"]
    out.send_json(HTTPStatus.OK, result_body(req, app.config, asked.get("logprobs"),
                                             asked.get("prompt_logprobs"), item.input_ids))


def handle_abort(out: Responder, app: App, raw: bytes) -> None:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise VLLMError(f"JSON decode error: {exc}", kind="Bad Request") from None
    ids = body.get("request_ids") if isinstance(body, dict) else None
    if ids is None:
        raise VLLMError("Missing 'request_ids' in request body", kind="Bad Request")
    count = sum(app.engine.abort(i.removeprefix(REQUEST_ID_PREFIX), exact=True)
                for i in ids if isinstance(i, str) and i.startswith(REQUEST_ID_PREFIX))
    logger.info("abort_requests %r: %d aborted", ids, count)
    out.send_empty(HTTPStatus.OK)  # type: ignore[attr-defined]


def models_list(config: SimulatorConfig, created: float) -> dict:
    return {"object": "list", "data": [{
        "id": config.model_path, "object": "model", "created": int(created),
        "owned_by": "vllm", "root": config.model_path, "parent": None,
        "max_model_len": config.context_len,
        "permission": [{"id": "modelperm-simulator", "object": "model_permission",
                        "created": int(created), "allow_create_engine": False,
                        "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}]}]}


def version() -> dict:
    return {"version": VLLM_VERSION}
