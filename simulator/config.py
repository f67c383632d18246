"""Knobs of the simulated SGLang server; one field per command-line flag."""

from dataclasses import dataclass, field

LENGTH_MODES = ("lognormal", "fixed:N", "uniform:A:B")
KINDS = ("sglang", "vllm")


@dataclass(frozen=True)
class SimulatorConfig:
    # Which server's HTTP API: SGLang 0.5.23's native one, or vLLM 0.32's token-in/token-out
    # one (simulator/vllm.py); the simulated engine is the same.
    kind: str = "sglang"
    host: str = "127.0.0.1"
    port: int = 0
    # The capacity model: a GPU server runs at most this many requests in one batch.
    max_running_requests: int = 64
    max_queued_requests: int | None = None
    # SGLang's --context-length: None (the default launch) leaves the model's own
    # max_position_embeddings in force, and /server_info then shows context_length null.
    context_length: int | None = None
    max_position_embeddings: int = 32768
    prefill_tokens_per_s: float = 20000.0
    decode_step_s: float = 0.02
    # A step with a full batch takes (1 + batch_slowdown) times a step with one request,
    # so aggregate tokens/s rises with the batch and then flattens.
    batch_slowdown: float = 1.0
    # Every simulated duration is multiplied by this; tests run at 0.01 or less.
    time_scale: float = 1.0
    mean_output_tokens: float = 3700.0
    sigma: float = 1.0
    # "lognormal" (mean_output_tokens, sigma), "fixed:N" or "uniform:A:B" (inclusive).
    lengths: str = "lognormal"
    seed: int = 0
    vocab_size: int = 32000
    eos_token_id: int = 2
    stream_interval: int = 1
    # Seconds after the start during which /health and /health_generate answer 503, as
    # SGLang's do while it loads the model (its port already listens). Wall-clock seconds,
    # not scaled by time_scale: it is how long a client must wait, not simulated GPU work.
    startup_s: float = 0.0
    # repr=False: the key must not end up in logs through the config's repr.
    api_key: str | None = field(default=None, repr=False)
    request_log: str | None = None
    model_path: str = "sim-model"
    log_level: str = "INFO"
    # SGLang with --tokenizer-worker-num 2 passes an unknown /abort_request rid on to the
    # scheduler, which aborts every request whose rid starts with it; with the default (1)
    # the tokenizer manager looks the rid up exactly and drops one it does not run.
    abort_by_prefix: bool = False

    def __post_init__(self) -> None:
        _check(self.kind in KINDS, "kind", self.kind)
        _check(self.max_running_requests >= 1, "max_running_requests", self.max_running_requests)
        _check(
            self.max_queued_requests is None or self.max_queued_requests >= 0,
            "max_queued_requests",
            self.max_queued_requests,
        )
        _check(self.context_length is None or self.context_length >= 2, "context_length",
               self.context_length)
        _check(self.max_position_embeddings >= 2, "max_position_embeddings",
               self.max_position_embeddings)
        _check(self.prefill_tokens_per_s > 0, "prefill_tokens_per_s", self.prefill_tokens_per_s)
        _check(self.decode_step_s > 0, "decode_step_s", self.decode_step_s)
        _check(self.batch_slowdown >= 0, "batch_slowdown", self.batch_slowdown)
        _check(self.time_scale > 0, "time_scale", self.time_scale)
        _check(self.mean_output_tokens >= 1, "mean_output_tokens", self.mean_output_tokens)
        _check(self.sigma >= 0, "sigma", self.sigma)
        _check(self.vocab_size >= 3, "vocab_size", self.vocab_size)
        _check(0 <= self.eos_token_id < self.vocab_size, "eos_token_id", self.eos_token_id)
        _check(self.stream_interval >= 1, "stream_interval", self.stream_interval)
        _check(self.startup_s >= 0, "startup_s", self.startup_s)
        _check(0 <= self.port <= 65535, "port", self.port)
        parse_lengths(self.lengths)

    @property
    def context_len(self) -> int:
        """The context length in force: --context-length, else the model's own."""
        return self.context_length or self.max_position_embeddings

    @property
    def max_total_num_tokens(self) -> int:
        # No KV-cache pressure is modelled: the pool always fits a full batch of full contexts.
        return self.max_running_requests * self.context_len

    @property
    def max_req_input_len(self) -> int:
        # SGLang: max_req_len = min(context_len - 1, max_total_num_tokens - 1); input is 5 less.
        return min(self.context_len - 1, self.max_total_num_tokens - 1) - 5


def parse_lengths(spec: str) -> tuple[str, int, int]:
    """`"fixed:7"` → ("fixed", 7, 7); `"uniform:3:9"` → ("uniform", 3, 9); lognormal → zeros."""
    parts = spec.split(":")
    try:
        if parts == ["lognormal"]:
            return ("lognormal", 0, 0)
        if parts[0] == "fixed" and len(parts) == 2:
            low = high = int(parts[1])
        elif parts[0] == "uniform" and len(parts) == 3:
            low, high = int(parts[1]), int(parts[2])
        else:
            raise ValueError(spec)
    except ValueError:
        raise ValueError(f"lengths: expected one of {LENGTH_MODES}, got {spec!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"lengths: need 1 <= A <= B, got {spec!r}")
    return (parts[0], low, high)


def _check(ok: bool, name: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: invalid value {value!r}")
