"""Bodies of the read-only SGLang endpoints: /model_info, /server_info, /v1/models."""

import dataclasses

from simulator.config import SimulatorConfig

SGLANG_VERSION = "0.5.23"
# Server arguments that must never be echoed back.
_SECRET_FIELDS = ("api_key",)


def model_info(config: SimulatorConfig) -> dict:
    return {
        "model_path": config.model_path,
        "tokenizer_path": config.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "simulator",
        "architectures": ["SimulatorForCausalLM"],
    }


def server_info(config: SimulatorConfig, running: int, waiting: int) -> dict:
    # The launch arguments as given: context_length is null unless --context-length was,
    # as on SGLang; the limits in force follow.
    args = {k: v for k, v in dataclasses.asdict(config).items() if k not in _SECRET_FIELDS}
    limits = {
        "max_total_num_tokens": config.max_total_num_tokens,
        "max_req_input_len": config.max_req_input_len,
    }
    return {
        **args,
        "tokenizer_path": config.model_path,
        "skip_tokenizer_init": False,
        **limits,
        "internal_states": [{**limits, "num_running_reqs": running, "num_waiting_reqs": waiting}],
        "version": SGLANG_VERSION,
        "simulator": True,
    }


def models_list(config: SimulatorConfig, created: float) -> dict:
    return {
        "object": "list",
        "data": [{
            "id": config.model_path,
            "object": "model",
            "created": int(created),
            "owned_by": "sglang",
            "root": config.model_path,
            "max_model_len": config.context_len,
        }],
    }
