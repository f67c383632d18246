"""One typed, frozen settings object for every process of a run.

The producer, every worker and Flower build their Celery app from the same
``Settings``: a shorter ``visibility_timeout_s`` on any client of the same Redis
database makes kombu redeliver running tasks, so no process may differ.

Precedence, lowest first: defaults here < TOML file (``--config`` or
``DATAGEN_CONFIG``) < environment (``DATAGEN_<FIELD>``) < explicit overrides
(command-line flags).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ENV_PREFIX = "DATAGEN_"
CONFIG_ENV = "DATAGEN_CONFIG"
BUDGET_MEASURES = ("trainable", "completion", "total")
REGENERATE_MODES = ("last", "each", "all")
EXTRACT_DTYPES = ("bfloat16", "float16", "float32")
EXTRACT_OVERLONG = ("truncate", "skip")
EXTRACT_BACKENDS = ("hf", "hf-tp", "sglang", "vllm", "captured")  # datagen/extraction/backends
SERVER_KINDS = ("sglang", "vllm", "auto")  # datagen/servers
STATES_TO = ("files", "stream")  # datagen/extraction/extractor.py, datagen/stream/sink.py


RENAMED = {"extract_max_length_tokens": "train_max_length"}
# Removed, and why (docs/DESIGN.md): a TOML or environment that still sets one fails loudly.
REMOVED = {"extract_file_format": "SpecForge reads only .ckpt files; the safetensors variant "
                                  "matched no trainer's contract"}


class SettingsError(ValueError):
    """A setting has a bad value; the message names the field and the value."""


@dataclass(frozen=True)
class Settings:
    # Where things are.
    redis_url: str = "redis://127.0.0.1:6379/0"  # broker + ledger; :password@, rediss:// TLS
    # A finished run whose Redis is gone (`make demo` leaves one): its saved dump.rdb.
    saved_ledger: str = ""  # status, dead, plot and estimate read this dump, not redis_url
    server_url: str = "http://127.0.0.1:30000"  # SGLang server or router (/generate)
    # "vllm": vLLM's token-in/token-out API (launched with --enable-scale-out); "auto": read
    # from the server's /v1/models once per process
    server_kind: str = "sglang"  # serves server_url, renders prompts: sglang, vllm or auto
    # The vLLM server writes each sample's hidden states while it generates (launched with
    # the arguments datagen.servers.capture.server_args gives, DESIGN.md); the training folder is
    # then built with extract_backend = "captured", no forward pass. server_kind "vllm" only.
    capture_states: bool = False  # states captured in the generation pass (vLLM only)
    capture_timeout_s: float = 600.0  # wait for a captured file after the answer
    # The `captured` build frees each captured file once its training row is durable (file
    # and manifest line written): one copy on disk at the peak, not two. A later build of a
    # changed training set (prepare --force) cannot rebuild those rows: keep them for that.
    keep_captured_states: bool = False  # keep states/<dataset>/<rid>.safetensors after the build
    # The server creates each file's lock before it answers: a worker that finds neither the
    # file nor its lock this many times in a row looks in another folder than the server
    # writes to, and gives the samples up at once (one clear reason) instead of re-running each
    capture_unseen_limit: int = 8  # files in a row with neither file nor lock: folders differ
    # Each record keeps the vLLM server's log-probability of every sampled token; extraction
    # checks the sample's final states against them (log_softmax(lm_head(state)) at the
    # token) and dead-letters a sample whose gap is past the tolerance (DESIGN.md).
    check_states: bool = True  # ask vLLM for the sampled logprobs and check every sample
    # Also ask vLLM for the prompt tokens' logprobs (prompt_logprobs) and check the prompt's
    # positions: a logits pass over the prompt on the server, and the request skips
    # vLLM's prefix cache (DESIGN.md, "Every state checked"). Off: only output positions.
    check_prompt_states: bool = False  # also check the prompt's positions (vLLM prompt_logprobs)
    check_positions_cpu: int = 32  # positions checked per sample on a CPU (all on a GPU); 0: all
    check_atol_nats: float = 0.01  # allowed gap besides the dtype's rounding of the logits
    # The state check allows the rounding of the dtype the generation server ran in
    # (datagen/extraction/tolerance.py), not the stored states' dtype: set it when the
    # server was started with another --dtype than the checkpoint's config.json names.
    server_dtype: str = "auto"  # the generation server's --dtype; auto: the checkpoint's own
    # The `captured` build re-captures this share of samples (the first of each gpu process
    # always) by a prefill of the same ids on server_url and compares every layer with the
    # file captured while generating: a disagreement fails the sample and is an alert in
    # `datagen status` (datagen/extraction/recapture.py). 0: never.
    recapture_share: float = 0.01  # share of captured samples cross-checked on the server
    api_key: str | None = None  # sent as `Authorization: Bearer` to SGLang
    data_dir: str = "data/demo/partition"  # a folder or .jsonl[.gz/.zst]/.parquet file per dataset
    partition: str = "all"  # datasets to run: "all" or a comma list of names
    output_dir: str = "runs/default"  # shared by every host: prompts, records, training data
    tokenizer_path: str = ""  # local tokenizer (with chat template) of the target model
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking
    # The tokenizer (producer) and the model (extraction) may be the checkpoint's own code.
    trust_remote_code: bool = False  # never run a checkpoint's own code unless asked
    # "last": only the last assistant turn is generated, earlier ones keep the dataset's text
    # (not trained on); "all": every assistant turn, in order, each after the generated ones.
    # "each": one sample per assistant turn, each from the recorded history before it (the
    # faithful choice for thinking templates and agent data); "all": the turns in order, each
    # after the generated ones (refused where that is not exact: tool turns, and a template
    # that rewrites earlier turns: reasoning split off at </think>, text trimmed)
    regenerate: str = "last"  # "last", "each" or "all" (refused for templates that rewrite history)

    # Queues: one source for the worker start commands (Makefile, compose).
    long_threshold_tokens: int = 2048  # prompts longer than this go to the `long` queue
    short_concurrency: int = 150  # threads of a `short` worker = its requests in flight
    short_max_tokens: int = 10240  # max_new_tokens of short prompts
    long_concurrency: int = 32  # threads of a `long` worker
    long_max_tokens: int = 16384  # max_new_tokens of long prompts
    context_length: int | None = None  # None: the server's; may lower it, not raise it
    # Off: every request may generate to its queue's cap, past what trains (for another
    # trainer or a later, longer window).
    cap_to_window: bool = True  # max_new_tokens <= what train_max_length leaves after the prompt
    # With cap_to_window: a prompt leaving fewer positions in the window is never sent
    # (reports/<dataset>.bad.txt says why).
    min_trainable_tokens: int = 64  # fewest generated tokens a sample must have room for
    sampling_params: dict[str, Any] = field(  # SGLang sampling_params besides max_new_tokens
        default_factory=lambda: {"temperature": 0.7, "top_p": 0.95}
    )

    # Budgets.
    token_budget: int = 10_000_000  # default budget of every dataset, in tokens
    budgets: dict[str, int] = field(default_factory=dict)  # per-dataset overrides
    # "trainable": what SpecForge trains: the generated tokens inside train_max_length but
    # the row's last (SpecForge zeroes its loss), so a 1-token answer counts 0;
    # "completion": every generated token; "total": completion + prompt.
    budget_counts: str = "trainable"  # "trainable" (what SpecForge trains), "completion", "total"
    max_samples: int | None = None  # also close a dataset after this many samples
    # Off: a response cut at max_new_tokens short of train_max_length is dead-lettered; one
    # whose row reaches it (every answer cap_to_window capped) is kept: nothing that trains lost.
    keep_truncated: bool = True  # keep cut answers; off: only those that fill train_max_length
    abort_on_close: bool = False  # a close aborts each in-flight request by its exact rid
    precise_admission: bool = True  # False: the naive stop-at-counter rule (baseline)
    # Higher lands closer to the budget from below, at the price of a slower finish.
    admission_margin_sd: float = 1.0  # reserve, in sd of what is in flight, at admission
    # Until this many responses are known, each request in flight counts at its cap.
    admission_min_responses: int = 1  # responses before the length model is used (16 until v3)

    # HTTP: every call carries both timeouts (the threads pool cannot kill a task).
    connect_timeout_s: float = 10.0  # connect timeout of every HTTP call
    read_timeout_s: float = 7200.0  # read timeout; on expiry the request is aborted on SGLang
    max_retries: int = 5  # retries of a failing request while the server is healthy
    retry_backoff_s: float = 2.0  # base of the exponential backoff (full jitter)

    # Celery/kombu. Early ack + no prefetch runs each task once (DESIGN.md, facts);
    # lost work after a crash is found through the ledger's leases instead.
    visibility_timeout_s: int = 43_200  # kombu's; must be the same in every process
    worker_pool: str = "threads"  # pool of the short/long workers
    log_each_task: bool = False  # Celery's received/succeeded lines of short/long tasks at INFO
    # A server's name that does not resolve for half a lease is taken for a host gone (before
    # that, no verdict: container DNS fails for seconds about live hosts; RELIABILITY.md).
    lease_s: float = 30.0  # a silent worker's samples re-run; a name unresolved lease/2: host gone
    shutdown_grace_s: float = 30.0  # SIGTERM: then in-flight requests are aborted, handed back

    flower_basic_auth: str = ""  # "user:password"; `datagen flower` makes one when empty
    flower_open_metrics: bool = False  # serve Flower's /metrics without its login
    # Off: Flower shows queue lengths and every task from the moment a worker receives it,
    # and the producer is ~1.6x faster. On: Flower also lists each queued task as PENDING.
    bulk_sent_events: bool = False  # task-sent events for the producer's bulk enqueue

    # Training set (`datagen prepare`): <output_dir>/training/{shards,manifest.json,...}.
    shard_samples: int = 500  # samples per shard = per `gpu` task (~1.5M tokens at 3K)
    shuffle_seed: int = 0  # seed of the training set's shuffle

    # Hidden-state extraction on the `gpu` queue (one worker per model replica).
    model_path: str = ""  # local HF model folder of the target model
    gpus: str = ""  # one replica's devices: "" one device (as CUDA_VISIBLE_DEVICES), "0-7", "cpu:2"
    extract_backend: str = "hf"  # "hf" one device, "hf-tp" transformers TP, "sglang", "vllm"
    # extract_backend = "captured": the files capture_states wrote, no forward pass
    # extract_backend = "vllm": a vLLM engine over the replica's devices (gpus), TP = their count
    vllm_python: str = ""  # Python of an environment with vLLM; "": this one (make vllm-env)
    vllm_args: str = ""  # more `vllm serve` arguments, shell-quoted ("--quantization ...")
    vllm_inflight: int = 64  # requests in flight per engine (it batches them)
    vllm_start_timeout_s: float = 1800.0  # loading a 1T model takes minutes
    replica_timeout_s: float = 600.0  # a rank silent this long in a collective ends the replica
    # TOML list or "1,15,28" in DATAGEN_AUX_LAYER_IDS.
    aux_layer_ids: list[int] | None = None  # aux decoder layers; None: [1, N//2-1, N-4]
    extract_dtype: str = "bfloat16"  # dtype of the forward pass and of the stored states
    extract_device: str = "auto"  # "auto": cuda when there is one (CUDA_VISIBLE_DEVICES)
    extract_attn_implementation: str = "sdpa"  # transformers attn_implementation
    # SpecForge's data.max_length (its default 2048): the files, the online rows and the run
    # config all use it, so the trainer never cuts or drops what was extracted.
    train_max_length: int = 2048  # tokens per sample kept; longer: extract_overlong decides
    extract_overlong: str = "truncate"  # "truncate" keeps the first tokens, "skip" drops
    extract_batch_tokens: int = 32768  # tokens per forward batch (the unit of OOM splitting)
    extract_writer_threads: int = 4  # threads writing files while the next batch runs
    extract_max_retries: int = 2  # whole-shard failures: Celery retries, then dead-letter
    extract_retry_countdown_s: float = 30.0  # wait before a shard's retry
    extraction_dir: str = ""  # "": <output_dir>/training/hidden_states
    calibration_path: str = ""  # "": <output_dir>/calibration.json
    draft_vocab_size: int = 32000  # draft vocabulary of vocab_mapping.pt (capped at the target's)

    # States straight into SpecForge (issue 45): "stream" puts each checked sample into the
    # running consumer's feature store and publishes its ref (datagen/stream/sink.py) instead
    # of writing a .ckpt file; nothing is dropped: extraction waits while the bytes the
    # trainer has not acknowledged would pass stream_resident_bytes. Every process of a run
    # (the gpu workers and `datagen extract`) reads the same values.
    states_to: str = "files"  # "files": .ckpt files; "stream": SpecForge's data plane
    stream_dir: str = ""  # "": <output_dir>/stream (the plane's plane.json and channel)
    stream_resident_bytes: int = 8 << 30  # bound on streamed bytes the trainer has not acked
    # Each epoch recomputes the states from the records by prefill in a fresh seeded order;
    # sample ids end in @e<epoch>, so the consumer trains each sample once per epoch.
    stream_epoch: int = 1  # the epoch `datagen extract` streams (2: a second pass, prefill)

    def __post_init__(self) -> None:
        _check_types(self)
        _positive(self, "short_concurrency", "long_concurrency", "short_max_tokens",
                  "long_max_tokens", "long_threshold_tokens", "token_budget",
                  "visibility_timeout_s")
        if self.server_kind not in SERVER_KINDS:
            raise SettingsError(
                f"server_kind: {self.server_kind!r} is not one of {SERVER_KINDS}")
        if self.regenerate not in REGENERATE_MODES:
            raise SettingsError(
                f"regenerate: {self.regenerate!r} is not one of {REGENERATE_MODES}")
        self._check_capture()
        if self.budget_counts not in BUDGET_MEASURES:
            raise SettingsError(
                f"budget_counts: {self.budget_counts!r} is not one of {BUDGET_MEASURES}")
        if self.max_samples is not None and self.max_samples < 1:
            raise SettingsError(f"max_samples: {self.max_samples!r} must be >= 1")
        if self.admission_min_responses < 1:
            raise SettingsError(
                f"admission_min_responses: {self.admission_min_responses!r} must be >= 1")
        if self.context_length is not None and self.context_length < 1:
            raise SettingsError(f"context_length: {self.context_length!r} must be >= 1")
        for name, budget in self.budgets.items():
            if not isinstance(budget, int) or budget < 0:
                raise SettingsError(f"budgets.{name}: {budget!r} must be an integer >= 0")
        _positive(self, "min_trainable_tokens", "shard_samples", "train_max_length",
                  "extract_batch_tokens", "extract_writer_threads", "draft_vocab_size",
                  "vllm_inflight")
        self._check_extraction()
        for url_field in ("redis_url", "server_url"):
            if "://" not in getattr(self, url_field):
                raise SettingsError(f"{url_field}: {masked_url(getattr(self, url_field))!r} "
                                    "is not a URL")

    def _check_capture(self) -> None:
        if not self.capture_states:
            return
        if self.server_kind != "vllm":
            raise SettingsError(f"capture_states: true needs server_kind = 'vllm' (its "
                                f"connector writes the states); server_kind is "
                                f"{self.server_kind!r}")
        if self.regenerate == "all":
            raise SettingsError(f"capture_states: true is not built for regenerate = "
                                f"{self.regenerate!r} (one request per turn); use 'last' or "
                                "'each'")
        if self.capture_timeout_s <= 0:
            raise SettingsError(f"capture_timeout_s: {self.capture_timeout_s!r} must be > 0")
        if self.capture_unseen_limit < 1:
            raise SettingsError(f"capture_unseen_limit: {self.capture_unseen_limit!r} must be "
                                ">= 1")
        n = self.sampling_params.get("n", 1)
        if n != 1:
            raise SettingsError(f"sampling_params.n = {n!r} with capture_states: every child "
                                "request would name the same states file (and the "
                                "connector's lock then blocks forever); use n = 1")

    def _check_extraction(self) -> None:
        for name, allowed in (("extract_dtype", EXTRACT_DTYPES),
                              ("server_dtype", ("auto", *EXTRACT_DTYPES)),
                              ("extract_overlong", EXTRACT_OVERLONG),
                              ("extract_backend", EXTRACT_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise SettingsError(f"{name}: {getattr(self, name)!r} is not one of {allowed}")
        if self.extract_max_retries < 0 or self.extract_retry_countdown_s < 0:
            raise SettingsError(f"extract_max_retries {self.extract_max_retries!r} and "
                                f"extract_retry_countdown_s {self.extract_retry_countdown_s!r} "
                                "must be >= 0")
        if self.check_prompt_states and not self.check_states:
            raise SettingsError("check_prompt_states: true needs check_states = true (the "
                                "prompt's positions are checked by the same state check)")
        if not 0.0 <= self.recapture_share <= 1.0:
            raise SettingsError(f"recapture_share: {self.recapture_share!r} must be between 0 "
                                "and 1")
        if self.check_positions_cpu < 0 or self.check_atol_nats <= 0:
            raise SettingsError(f"check_positions_cpu {self.check_positions_cpu!r} must be "
                                f">= 0 and check_atol_nats {self.check_atol_nats!r} > 0")
        if self.vllm_start_timeout_s <= 0:
            raise SettingsError(f"vllm_start_timeout_s: {self.vllm_start_timeout_s!r} must be > 0")
        if self.replica_timeout_s <= 0:
            raise SettingsError(f"replica_timeout_s: {self.replica_timeout_s!r} must be > 0")
        self._check_stream()
        if self.aux_layer_ids is not None:
            # frozen: the one normalisation, from the environment's string to a list
            object.__setattr__(self, "aux_layer_ids", _layer_ids(self.aux_layer_ids))

    def _check_stream(self) -> None:
        if self.states_to not in STATES_TO:
            raise SettingsError(f"states_to: {self.states_to!r} is not one of {STATES_TO}")
        _positive(self, "stream_resident_bytes", "stream_epoch")
        if self.stream_epoch > 1 and self.states_to != "stream":
            raise SettingsError(f"stream_epoch: {self.stream_epoch!r} needs states_to = "
                                "'stream' (the file build writes one set of files)")
        if self.stream_epoch > 1 and self.extract_backend == "captured":
            raise SettingsError(f"stream_epoch: {self.stream_epoch!r} with extract_backend = "
                                "'captured': the captured states are freed once published; "
                                "a later epoch recomputes them by prefill (hf, hf-tp, sglang "
                                "or vllm)")

    def budget_for(self, dataset: str) -> int:
        return self.budgets.get(dataset, self.token_budget)

    def queue_limits(self, queue: str) -> tuple[int, int]:
        """(concurrency, max_new_tokens) of the ``short`` or ``long`` queue."""
        if queue == "short":
            return self.short_concurrency, self.short_max_tokens
        return self.long_concurrency, self.long_max_tokens

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def public(self) -> dict[str, Any]:
        """The settings as a dict that is safe to print or log."""
        out = dataclasses.asdict(self)
        out["redis_url"] = masked_url(self.redis_url)
        out["server_url"] = masked_url(self.server_url)
        for secret in ("api_key", "flower_basic_auth"):
            if out[secret]:
                out[secret] = "***"
        return out


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Settings)


def _check_types(settings: Settings) -> None:
    """Every value has its field's type (a TOML `lease_s = "30"` is refused, naming the
    setting); an int where a float is expected becomes that float."""
    for name, kind in _field_types().items():
        value = getattr(settings, name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(settings, name, float(value))  # frozen: the one widening
        elif not _is_a(value, kind):
            raise SettingsError(f"{name}: {value!r} is not {_type_name(kind)}")


def _is_a(value: Any, kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_is_a(value, arg) for arg in args)
    if kind is type(None):
        return value is None
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, float)
    if origin is list:
        # aux_layer_ids: a list, or the environment's "1,15,28" that _layer_ids parses
        return isinstance(value, list | tuple | str) and (
            isinstance(value, str) or all(_is_a(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _is_a(v, args[1]) for k, v in value.items())
    return isinstance(value, kind)


def _type_name(kind: Any) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             type(None): "unset"}
    if typing.get_origin(kind) in (types.UnionType, typing.Union):
        return " or ".join(_type_name(arg) for arg in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return "a list of integers"
    if typing.get_origin(kind) is dict:
        return "a table" + (" of integers" if typing.get_args(kind)[1] is int else "")
    return names.get(kind, str(kind))


def _positive(settings: Settings, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SettingsError(f"{name}: {value!r} must be an integer >= 1")


def _layer_ids(value: Any) -> list[int] | None:
    """aux_layer_ids from TOML (a list) or the environment ("1,15,28" or "[1, 15, 28]")."""
    if isinstance(value, str):
        text = value.strip().strip("[]")
        if not text:
            return None
        try:
            value = [int(part) for part in text.split(",")]
        except ValueError as exc:
            raise SettingsError(f"aux_layer_ids: {value!r} is not a list of integers") from exc
    if (not isinstance(value, list | tuple) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
        raise SettingsError(f"aux_layer_ids: {value!r} must be a list of layer ids >= 0")
    return list(value)


def masked_url(url: str) -> str:
    """The URL with any password replaced by ***, for logs and status output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def load_settings(config_path: str | Path | None = None,
                  env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}  # where each value came from, for the error message
    path = config_path or env.get(CONFIG_ENV)
    if path:
        values.update(toml := _read_toml(Path(path)))
        origin.update(dict.fromkeys(toml, f"config file {path}"))
    values.update(from_env := _from_env(env))
    origin.update({k: f"environment {ENV_PREFIX}{k.upper()}" for k in from_env})
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings(**values)
    except TypeError as exc:
        raise SettingsError(str(exc)) from exc
    except SettingsError as exc:
        source = origin.get(str(exc).split(":", 1)[0].split(".", 1)[0])
        raise SettingsError(f"{source}: {exc}" if source else str(exc)) from exc


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SettingsError(f"config file {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc
    known = {f.name for f in fields(Settings)}
    for old, new in RENAMED.items():
        if old in raw:
            raise SettingsError(f"config file {path}: {old} is now {new} (one limit for the "
                                "extraction and the trainer's max_length)")
    for old, why in REMOVED.items():
        if old in raw:
            raise SettingsError(f"config file {path}: {old} was removed: {why}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SettingsError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
    return raw


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for old, new in RENAMED.items():
        if ENV_PREFIX + old.upper() in env:
            raise SettingsError(f"{ENV_PREFIX}{old.upper()} is now {ENV_PREFIX}{new.upper()}")
    for old, why in REMOVED.items():
        if ENV_PREFIX + old.upper() in env:
            raise SettingsError(f"{ENV_PREFIX}{old.upper()} was removed: {why}")
    for name, kind in _field_types().items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            out[name] = _coerce(name, raw, kind)
    return out


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, raw: str, kind: Any) -> Any:
    """An environment string as the field's type; the type check then refuses what is not."""
    args = typing.get_args(kind)
    if type(None) in args:
        if raw == "":
            return None
        kind = next(arg for arg in args if arg is not type(None))
    text = raw.strip()
    try:
        if typing.get_origin(kind) is dict:
            return json.loads(text)
        if kind is bool:
            if text.lower() not in TRUE + FALSE:
                raise ValueError(text)
            return text.lower() in TRUE
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError as exc:
        raise SettingsError(f"environment {ENV_PREFIX}{name.upper()}: {raw!r} is not "
                            f"{_type_name(kind)}") from exc
    return raw


def settings_fields() -> list[tuple[str, Any, str]]:
    """(name, default, environment variable) for the configuration reference."""
    defaults = Settings()
    return [(f.name, getattr(defaults, f.name), ENV_PREFIX + f.name.upper())
            for f in fields(Settings)]
