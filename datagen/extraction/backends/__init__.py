"""The model side of extraction: swappable implementations behind one small interface
(``base.Backend``). torch and the model libraries load only when a backend is created."""

from __future__ import annotations

from typing import Any

NAMES = ("hf", "hf-tp", "sglang", "vllm", "captured")
# backends whose model spans the replica's ranks: each rank loads its part, all run each row
DISTRIBUTED = ("hf-tp", "sglang")
# the backend whose engine spans the replica's devices by itself: one worker process
ENGINE = "vllm"


def create(name: str, cfg: Any, device: Any) -> Any:
    """The backend ``name`` for an ExtractionConfig, its model loaded onto ``device``."""
    if name == "hf":
        from datagen.extraction.backends import hf
        return hf.create(cfg, device)
    if name == "hf-tp":
        from datagen.extraction.backends import hf_tp
        return hf_tp.create(cfg, device)
    if name == "sglang":
        from datagen.extraction.backends import sglang
        return sglang.create(cfg, device)
    if name == "vllm":
        from datagen.extraction.backends import vllm
        return vllm.create(cfg, device)
    if name == "captured":
        from datagen.extraction.backends import captured
        return captured.create(cfg, device)
    raise ValueError(f"extract_backend={name!r}: expected one of {list(NAMES)}")
