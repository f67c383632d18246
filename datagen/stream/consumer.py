"""The run config of SpecForge 0.2.0's stock consumer (``specforge train --role consumer``) that
trains on what a stream publishes, and the command line that starts it.

It is the handoff's run config (``specforge_train.json``: target, draft config, vocab mapping,
max_length, written by ``datagen extract``/``datagen handoff``) turned online and
disaggregated: ``deployment.mode = "disaggregated"``, ``backend = "mooncake"`` with the plane's
addresses and store id, ``control_dir`` the folder of the plane's ``refs.jsonl`` (SpecForge
derives the channel path from it), ``consumer_state_dir`` the plane's (its consumer.sqlite),
``training.total_steps`` = samples × epochs / (batch × accumulation) (each epoch's sample is
its own ref), and on a CPU ``training.fsdp_sharding = "NO_SHARD"`` (SpecForge's sharded FSDP
needs a GPU) and ``training.attention_backend = "sdpa"`` (its default flex attention has no
backward on a CPU). SpecForge's schema wants an online data source although the consumer reads none
(the producer is this project): ``data.prompts_path`` names an empty file.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from datagen.errors import BadInput
from datagen.generation.records import atomic_file
from datagen.stream.plane import PlaneInfo

CONSUMER_CONFIG_NAME = "specforge_consumer.json"
NO_PROMPTS_NAME = "no_prompts.jsonl"


def read_handoff_config(path: Path) -> dict[str, Any]:
    """The offline run config `datagen extract` wrote (its model and max_length are reused)."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        return {"model": dict(body["model"]), "max_length": int(body["data"]["max_length"])}
    except FileNotFoundError:
        raise BadInput(f"{path} is missing: the stream's consumer needs the handoff's target, "
                       "draft config and vocab mapping (`datagen handoff` writes them)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"{path} is not a SpecForge run config: {exc!r}") from exc


def total_steps(samples: int, epochs: int, batch_size: int = 1,
                accumulation_steps: int = 1) -> int:
    """SpecForge's online horizon (training/schedule.py): whole optimizer windows only."""
    if samples < 1 or epochs < 1:
        raise BadInput(f"samples {samples} and epochs {epochs} must be positive")
    steps = samples * epochs // (batch_size * accumulation_steps)
    if steps < 1:
        raise BadInput(f"{samples} samples x {epochs} epochs fill no optimizer step of "
                       f"{batch_size * accumulation_steps} samples")
    return steps


def consumer_config(handoff: dict[str, Any], plane: PlaneInfo, samples: int, epochs: int = 1,
                    cpu: bool = False, save_interval: int = 0) -> dict[str, Any]:
    """The consumer's run config (SpecForge's typed schema, specforge/config/schema.py)."""
    control_dir = Path(plane.channel_path).parent
    if Path(plane.channel_path).name != "refs.jsonl":
        raise BadInput(f"channel {plane.channel_path}: SpecForge derives <control_dir>/refs.jsonl")
    training: dict[str, Any] = {"strategy": "eagle3", "batch_size": 1,
                                "total_steps": total_steps(samples, epochs),
                                "save_interval": save_interval}
    model = dict(handoff["model"])
    if cpu:  # sharded FSDP and flex attention's backward need a GPU
        training.update(fsdp_sharding="NO_SHARD", attention_backend="sdpa")
        model["torch_dtype"] = "float32"
    return {
        "model": model,
        "data": {"prompts_path": str(control_dir / NO_PROMPTS_NAME),
                 "max_length": handoff["max_length"], "dataloader_num_workers": 0},
        "training": training,
        "deployment": {"mode": "disaggregated", "disaggregated": {
            "control_dir": str(control_dir), "consumer_state_dir": plane.state_dir,
            "backend": "mooncake", "store_id": plane.store_id,
            "mooncake_metadata_server": plane.metadata_url,
            "mooncake_master_server_addr": plane.master_addr,
            "mooncake_local_hostname": "127.0.0.1", "mooncake_protocol": plane.protocol}},
        "run_id": plane.store_id,
        "output_dir": str(control_dir.parent / "specforge_output"),
    }


def write_consumer_config(stream_dir: Path, body: dict[str, Any]) -> Path:
    prompts = Path(body["data"]["prompts_path"])
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.touch()
    path = Path(stream_dir) / CONSUMER_CONFIG_NAME
    with atomic_file(path) as fh:
        fh.write(json.dumps(body, indent=2) + "\n")
    return path


def consumer_command(config: Path) -> str:
    return f"specforge train --config {shlex.quote(str(config))} --role consumer"


def describe(plane: PlaneInfo, config: Path) -> str:
    """What `datagen stream` prints: the plane, the env SpecForge reads, the command."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plane.env().items())
    return "\n".join([
        f"Mooncake plane up: master {plane.master_addr}, metadata {plane.metadata_url}, "
        f"store id {plane.store_id}, segment holder pid {plane.holder_pid} "
        f"({plane.segment_bytes:,} bytes)",
        f"  refs channel: {plane.channel_path}",
        f"  consumer state: {plane.state_dir}",
        f"  env (the config sets the same): {env}",
        f"  train: {consumer_command(config)}"])
