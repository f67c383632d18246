"""Runs SpecForge 0.2.0's own `specforge train` CLI entry in this process, on a CPU.

CPU STAND-IN, for the tests and `make demo STREAM=1` on a CPU only: SpecForge's EAGLE-3 loss
(``specforge.core.loss.LogSoftmaxLoss``) is a Triton kernel with no CPU path, and Triton is not
installed here. This launcher gives ``specforge.core.loss`` an inert ``triton`` module to
import (its kernels are never launched) and swaps ``LogSoftmaxLoss`` for the torch formula
that sits in the same file (``_compute_loss``: -sum(mask * target_p * log_softmax(logits)),
mean over positions), which is the kernel's reference. Everything else is SpecForge's:
config, data plane, trainer, checkpoints, acks.

A second CPU adaptation, for speed only: the run config of ``datagen stream --cpu`` trains the
draft in float32 (``model.torch_dtype``), because bf16 matrix products on a CPU without
AVX512-BF16 take a scalar path (a demo-sized step took ~10 s in bf16); the stream's bf16 states
are widened to float32 as each batch enters the EAGLE-3 strategy, and so is the target's
frozen lm_head it scores them with (``widen_batches``). The
published tensors, and what a GPU consumer reads, stay bf16.

    python -m datagen.stream.cpu_consumer train --config <consumer.json> --role consumer

On a GPU host the consumer is SpecForge's own ``specforge train --config <consumer.json> --role
consumer`` (datagen/stream/consumer.py prints it); this stand-in trains no drafter to ship.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import torch


def _import_loss_with_inert_triton() -> types.ModuleType:
    """specforge.core.loss imported with a ``triton`` stand-in that exists only while it
    imports (its kernels are never launched), and ``torch.compile`` a no-op meanwhile (so
    torch's compiler, which would find the stand-in, is not loaded, and the file's reference
    formula stays a plain function: no C compiler is needed on the CPU)."""
    if "triton" in sys.modules:
        from specforge.core import loss
        return loss
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)  # type: ignore[attr-defined]
    triton.next_power_of_2 = lambda n: 1 << max(0, int(n) - 1).bit_length()  # type: ignore[attr-defined]
    language.constexpr = int  # type: ignore[attr-defined]
    triton.language = language  # type: ignore[attr-defined]
    sys.modules["triton"], sys.modules["triton.language"] = triton, language
    compile_ = torch.compile
    torch.compile = lambda *_, **__: (lambda fn: fn)  # type: ignore[assignment]
    try:
        from specforge.core import loss
    finally:
        torch.compile = compile_
        del sys.modules["triton"], sys.modules["triton.language"]
    return loss


class CpuLogSoftmaxLoss:
    """CPU stand-in for SpecForge's Triton LogSoftmaxLoss: same call, torch formula."""

    @staticmethod
    def apply(logits: torch.Tensor, target: torch.Tensor,
              position_mask: torch.Tensor) -> torch.Tensor:
        from specforge.core import loss

        return loss._compute_loss(logits, target, position_mask)


def install_cpu_loss() -> None:
    loss = _import_loss_with_inert_triton()
    from specforge.algorithms.eagle3 import model

    loss.LogSoftmaxLoss = CpuLogSoftmaxLoss
    model.LogSoftmaxLoss = CpuLogSoftmaxLoss


def widen_batches() -> None:
    """Each batch's floating tensors (the stream's bf16 states) to float32 before SpecForge's
    EAGLE-3 strategy runs it, to match a float32 draft on a CPU."""
    from specforge.training.strategies.base import Eagle3TrainStrategy

    forward_loss = Eagle3TrainStrategy.forward_loss

    def widened(self: Any, batch: Any, ctx: Any = None) -> Any:
        if getattr(self, "target_head", None) is not None:  # the target's frozen lm_head
            self.target_head.float()
        batch.tensors = {k: v.float() if v.is_floating_point() else v
                         for k, v in batch.tensors.items()}
        return forward_loss(self, batch, ctx)

    Eagle3TrainStrategy.forward_loss = widened  # type: ignore[method-assign]


def command(config: str | Path) -> list[str]:
    """The consumer's command line on a CPU, run with this interpreter."""
    return [sys.executable, "-m", "datagen.stream.cpu_consumer", "train", "--config",
            str(config), "--role", "consumer"]


# torchrun's variables of a parent: SpecForge would join that process group
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def start(config: str | Path, log: Path, *overrides: str) -> subprocess.Popen[bytes]:
    """The CPU consumer in a session of its own (its group can be stopped whole), its
    output appended to ``log``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    with open(log, "ab") as fh:
        return subprocess.Popen([*command(config), *overrides], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def main(argv: list[str]) -> int:
    install_cpu_loss()
    widen_batches()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
