"""The aux cross-check no engine offers (``recapture_share``): a captured sample's states
against a prefill of the same ids on the generation server.

The log-probability check (integrity.py) reads the final state at the output positions only:
the aux layers and the prompt's positions have no number of the engine's to be checked
against. So for a share of the `captured` build's samples (``recapture_share``, seeded by the
sample's id; the first sample of each extraction process always) the gpu worker asks the
generation server (``server_url``, its capture connector on) for a prefill of the sample's
exact ids, max one new token, its states written to ``states/_recapture/`` beside the run's,
and compares it with the file captured while generating, every position and every layer (aux
layers one by one, then the final): different code paths of the same engine (decode steps
against a chunked prefill), so a row that one of them put out of line, a block left
unwritten, a prefill chunk gone wrong shows up as a whole position apart. A position of a
layer differs when ‖ours − prefill's‖ / ‖prefill's‖ exceeds the recompute tolerance of the
server's dtype (tolerance.py), ``FLOOR`` at least; the sample then fails the state check with
what differs, where, and by how much, and the run's total counts it as an alert
(tally.py: ``datagen extract`` and ``datagen status`` print it). A server that cannot be
reached leaves the sample unchecked by this (logged), never failed.
"""

from __future__ import annotations

import logging
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datagen.extraction.integrity import Checked, StateCheckFailed
from datagen.extraction.tolerance import Tolerance

log = logging.getLogger(__name__)

FLOOR = 1e-3         # relative: a float32 prefill equals the generation pass to 0.0 on vLLM's CPU
RELEASE_TIMEOUT_S = 600.0  # the connector's write of the prefill's file
DATASET = "_recapture"  # states/ folder of the prefills (no dataset name starts with _)


@dataclass(frozen=True)
class Differs:
    name: str       # the tensor
    layer: int      # its aux layer id (-1: the final state)
    position: int
    relative: float  # ‖ours − prefill's‖ / ‖prefill's‖ at that position and layer


def worst_difference(ours: torch.Tensor, theirs: torch.Tensor, layers: int
                     ) -> tuple[int, int, float]:
    """(layer index, position, relative difference) of the worst position of ``ours``
    [n, layers·H] against ``theirs``, layer by layer."""
    n = ours.shape[0]
    a = ours.reshape(n, layers, -1).float()
    b = theirs.reshape(n, layers, -1).float()
    rel = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)  # [n, layers]
    flat = int(rel.argmax())
    return flat % layers, flat // layers, float(rel.flatten()[flat])


class Recapture:
    """Re-captures a share of samples on the server and compares them with their files."""

    def __init__(self, server_url: str, run_dir: str | Path, share: float,
                 aux_layer_ids: tuple[int, ...], allowed: Tolerance, api_key: str | None = None):
        from datagen.client import SGLangClient

        self.client = SGLangClient(server_url, kind="vllm", api_key=api_key)
        self.run_dir = Path(run_dir)
        self.share = share
        self.aux_layer_ids = aux_layer_ids
        self.allowed = allowed
        self._first = True
        self._lock = threading.Lock()

    def wanted(self, sample: Any) -> bool:
        """The first sample this process sees, then ``share`` of them by their ids."""
        with self._lock:
            if self._first:
                self._first = False
                return True
        key = zlib.crc32(f"{sample.dataset}/{sample.id}".encode())
        return key < self.share * 2 ** 32

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(aux [n, 3H], final [n, H]) the server captures for a prefill of ``ids``; None
        when it cannot be reached."""
        from safetensors.torch import load_file

        from datagen.client import new_rid
        from datagen.errors import DatagenError
        from datagen.servers import capture

        rid = new_rid(DATASET)
        path = capture.states_path(self.run_dir, DATASET, rid)
        try:
            self.client.generate(ids, {"max_new_tokens": 1, "temperature": 0}, rid,
                                 extra={"kv_transfer_params": capture.request_params(path)})
            if not capture.wait_released(path, RELEASE_TIMEOUT_S) or not path.is_file():
                raise OSError(f"{path}: the server wrote no states for the prefill")
            states = load_file(str(path))
            return states["aux_hidden_state"].clone(), states["hidden_state"].clone()
        except (DatagenError, OSError) as exc:
            log.warning("re-capture on %s not done (%s): the sample's aux states stay "
                        "unchecked", self.client.base_url, exc)
            return None
        finally:
            path.unlink(missing_ok=True)
            Path(f"{path}.lock").unlink(missing_ok=True)

    def differs(self, aux: torch.Tensor, final: torch.Tensor, theirs: tuple[torch.Tensor,
                torch.Tensor]) -> Differs | None:
        """The worst position and layer past the tolerance, or None."""
        rtol = max(FLOOR, self.allowed.rtol(final.dtype))
        n = final.shape[0]
        found = []
        for name, ours, other, layers in (("aux_hidden_state", aux, theirs[0],
                                           len(self.aux_layer_ids)),
                                          ("hidden_state", final, theirs[1], 1)):
            layer, position, rel = worst_difference(ours[:n], other[:n].to(ours.dtype), layers)
            if rel > rtol:
                found.append(Differs(name, self.aux_layer_ids[layer] if layers > 1 else -1,
                                     position, rel))
        return max(found, key=lambda d: d.relative) if found else None

    def check(self, sample: Any, aux: torch.Tensor, final: torch.Tensor) -> bool:
        """StateCheckFailed when the server's prefill of the sample's ids gives other states;
        True when compared, False when the server could not be reached."""
        theirs = self.prefill(list(sample.input_ids))
        if theirs is None:
            return False
        if theirs[1].shape[0] < final.shape[0]:
            raise StateCheckFailed(f"re-capture: the server's prefill holds "
                                   f"{theirs[1].shape[0]} positions, the file "
                                   f"{final.shape[0]}", Checked(0, 0.0, -1, 1.0,
                                                                recaptured=True))
        found = self.differs(aux, final, theirs)
        if found is None:
            return True
        rtol = max(FLOOR, self.allowed.rtol(final.dtype))
        where = f"aux layer {found.layer}" if found.layer >= 0 else "the final state"
        raise StateCheckFailed(
            f"re-capture: {where} ({found.name}) at position {found.position} is "
            f"{found.relative:.3g} (relative) from a prefill of the same ids on "
            f"{self.client.base_url} (allowed {rtol:.3g}): the states captured while "
            "generating are not the model's", Checked(0, 0.0, found.position,
                                                      found.relative - rtol, recaptured=True))
