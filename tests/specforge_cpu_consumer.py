"""Runs SpecForge 0.2.0's own `specforge train` CLI entry in this process, on a CPU.

CPU STAND-IN, for the tests only: SpecForge's EAGLE-3 loss (``specforge.core.loss
.LogSoftmaxLoss``) is a Triton kernel with no CPU path, and Triton is not installed here. This
launcher gives ``specforge.core.loss`` an inert ``triton`` module to import (its kernels are
never launched) and swaps ``LogSoftmaxLoss`` for the torch formula that sits in the same file
(``_compute_loss``: -sum(mask * target_p * log_softmax(logits)), mean over positions), which
is the kernel's reference. Everything else is SpecForge's: config, data plane, trainer,
checkpoints, acks.

    python tests/specforge_cpu_consumer.py train --config <consumer.json> --role consumer
"""

from __future__ import annotations

import sys
import types

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


def main(argv: list[str]) -> int:
    install_cpu_loss()
    from specforge.cli import main as specforge_main

    return specforge_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
