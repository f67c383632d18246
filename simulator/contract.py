"""SGLang 0.5.23's JSON contract gate for /generate, as far as the simulator needs it.

Before anything else, SGLang decodes the body against its API schema (``proto/sglang/api/v1``,
a Rust decoder: ``sglang.srt.entrypoints.api_contract``) and answers 400 with the decoder's
own text in ``{"error": "<text>"}`` (a string, not the ``{"message": ...}`` object of the
later checks). The texts below are serde's, taken from that decoder in 0.5.23: an unknown
sampling_params key (the first one, in the body's order) and a value of the wrong JSON type
for the fields the simulator reads.
"""

from http import HTTPStatus

from simulator.errors import ApiError

# The schema's SamplingParams fields, in its order (the order of serde's "expected one of").
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
_INTEGER_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval",
                   "sampling_seed")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")


class ContractError(ApiError):
    """400 with the schema decoder's text as the whole ``error`` value."""

    def __init__(self, message: str) -> None:
        super().__init__(HTTPStatus.BAD_REQUEST, message)

    def body(self) -> dict:
        return {"error": self.message}


def check_contract(body: dict) -> None:
    """Raise ContractError where SGLang's schema decoder refuses the body."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ContractError(_invalid(stream, "a boolean"))
    params = body.get("sampling_params")
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict):
            _check_sampling(one)


def _check_sampling(params: dict) -> None:
    for key, value in params.items():
        if key not in SAMPLING_FIELDS:
            expected = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
        if value is None:
            continue  # every field is optional
        if key in _INTEGER_FIELDS and not _is_int(value):
            raise ContractError(_invalid(value, "i64"))
        if key in _FLOAT_FIELDS and not (_is_int(value) or isinstance(value, float)):
            raise ContractError(_invalid(value, "f64"))
        if key in _BOOL_FIELDS and not isinstance(value, bool):
            raise ContractError(_invalid(value, "a boolean"))
        if key == "stop_token_ids" and isinstance(value, list):
            for item in value:
                if not _is_int(item):
                    raise ContractError(_invalid(item, "i64"))


def _invalid(value: object, expected: str) -> str:
    """serde_json's "invalid type" text for a JSON value."""
    if isinstance(value, bool):
        shown = f"boolean `{str(value).lower()}`"
    elif isinstance(value, int):
        shown = f"integer `{value}`"
    elif isinstance(value, float):
        shown = f"floating point `{value!r}`"
    elif isinstance(value, str):
        shown = f'string "{value}"'
    elif isinstance(value, list):
        shown = "sequence"
    else:
        shown = "map"
    return f"invalid type: {shown}, expected {expected}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
