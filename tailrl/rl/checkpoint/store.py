"""RL checkpoints: `run/checkpoints/step_NNNNNN/` with the policy (HF safetensors; a LoRA run: its adapter in PEFT's
format, rl/actor/lora_io.py), the trainer state (optimizer,
RNG, step, data position, history index, drafter trainer: trainer_state.json + trainer_state.safetensors, see
state_io.py), the config and the learned drafter head. A run of N trainer ranks also writes `dcp/`: the ranks'
shards of the fp32 weights and AdamW's moments (sharded_io.py), which any world size resumes from; its `model/`
is the HF export, written a layer at a time (a LoRA run's: dcp/ holds the adapters and their moments, model/ the
adapter in PEFT's format, written by rank 0).

Invariants:
- A checkpoint exists whole or not at all: it is written to `.tmp_step_N` and renamed; `latest` is replaced
  atomically after the rename. A failed write (a full disk) removes the partial folder and leaves the previous
  checkpoint and `latest` as they were.
- A policy with a non-finite weight is never written.
- Loading runs no code from the folder: every file is safetensors or JSON (a drafter's hot_token_ids.pt is read
  with torch.load(weights_only=True); DCP's pickled metadata with an allow-list unpickler, sharded_io.py). An old checkpoint whose state is a pickle (trainer_state.pt) is read only
  with trust_pickled, and is then rewritten in the new format.
- Reading falls back: a missing or corrupt `latest`, a checkpoint whose files do not load, or one whose fields
  fail the caller's check (state_check.py) gives a one-line warning naming the file or field, and the next
  older checkpoint is tried; when checkpoints exist and none is usable, a CheckpointError says so.
- Pruning keeps the newest `keep` checkpoints at or before the step just written (newer ones belong to a
  timeline abandoned by a fallback)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError

from ...drafter.eagle import EagleDrafter, load_drafter, save_drafter
from .state_io import (PICKLED, STATE_JSON, STATE_TENSORS, StateError, convert_pickled, is_pickled, read_pickled_state,
                       read_state, write_state)

log = logging.getLogger(__name__)
_STEP = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


@dataclass
class Loaded:
    path: Path
    model: dict  # state dict of the policy as saved (tied LM head not repeated)
    state: dict  # the trainer state (state_io.read_state)
    config: dict  # the run's config when it was saved
    drafter: EagleDrafter | None
    sharded: Path | None = None  # the dcp/ folder of a checkpoint written by N ranks (the weights are there)


class ModelWriter(Protocol):
    """What a checkpoint asks of the actor (actor.Actor, actor_group.ActorGroup)."""

    def non_finite(self) -> list[str]: ...  # names of parameters holding NaN/inf

    def write_model(self, folder: Path, final: bool) -> None: ...  # folder/model (HF), and folder/dcp when sharded


def non_finite_params(module: torch.nn.Module) -> list[str]:
    return [n for n, p in module.named_parameters() if not bool(torch.isfinite(p).all())]


def step_dirs(root: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_name(root: Path) -> str | None:
    f = root / "latest"
    try:
        name = f.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP.match(name) else None


def save_checkpoint(root: Path, step: int, actor: ModelWriter, tokenizer, state: dict, config: dict,
                    head: EagleDrafter | None = None, keep: int = 2, final: bool = False) -> Path:
    bad = actor.non_finite()
    if bad:
        prev = latest_name(root)
        raise CheckpointError(f"refusing to save step {step}: {len(bad)} policy tensors hold NaN/inf ({', '.join(bad[:3])}); "
                              f"the latest checkpoint stays {prev or 'none'}")
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        actor.write_model(tmp, final)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "model"))
        if head is not None:
            save_drafter(head, tmp / "drafter", meta={"rl_step": step})
        write_state(tmp, state)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # a checkpoint exists whole or not at all
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
    except (OSError, RuntimeError, SafetensorError) as e:  # safetensors reports a full disk as a SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_name(root)
        why = getattr(e, "strerror", None) or str(e).strip()
        raise CheckpointError(f"could not write the checkpoint of step {step} to {root}: {why} ({free_space(root)}); "
                              f"the previous checkpoint ({prev or 'none'}) is intact") from e
    prune(root, step, keep)
    return final


def _existing(root: Path) -> Path | None:
    """root, or its nearest ancestor that exists (the disk a folder about to be created will be on)."""
    return next((q for q in (root, *root.parents) if q.exists()), None)


def free_space(root: Path) -> str:
    """'N MB free on that disk', for errors about writing there."""
    try:
        return f"{shutil.disk_usage(_existing(root)).free / 2**20:.0f} MB free on that disk"
    except (OSError, TypeError):
        return "free space unknown"


def disk_warning(root: Path, policy, keep: int) -> str | None:
    """A warning when the disk under root cannot hold the checkpoints the run will keep: keep + 1 (a new one is
    written before the oldest is pruned), each about the fp32 weights plus AdamW's two moments."""
    each = 3 * 4 * sum(p.numel() for p in policy.parameters())  # parameters() lists a tied weight once
    need = (keep + 1) * each
    probe = _existing(root)
    free = shutil.disk_usage(probe).free if probe is not None else need
    if free >= need:
        return None
    return (f"{free / 2**30:.1f} GB free under {probe}, and the run's checkpoints need about {need / 2**30:.1f} GB "
            f"({keep + 1} x {each / 2**30:.2f} GB: trainer.keep_checkpoints={keep}, plus the one being written): a save "
            "will fail when the disk fills (the previous checkpoint stays intact)")


def prune(root: Path, step: int, keep: int) -> None:
    dirs = step_dirs(root)
    kept = [p for p in dirs if int(p.name[5:]) <= step][-keep:]
    for p in dirs:
        if p not in kept:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp_step_*"):  # left by a run killed while saving
        shutil.rmtree(p, ignore_errors=True)


def candidates(root: Path) -> list[Path]:
    """The checkpoint `latest` names, then every other complete one, newest first."""
    dirs = step_dirs(root)[::-1]
    name = latest_name(root)
    if dirs and (name is None or not (root / name).is_dir()):
        log.warning("%s is missing or corrupt: using the newest checkpoint folder instead", root / "latest")
        return dirs
    return [root / name] + [d for d in dirs if d.name != name] if name else dirs


def load_checkpoint(root: Path, check=None, trust_pickled: bool = False) -> Loaded | None:
    """The newest checkpoint under root whose files all load and pass `check(loaded)` (which raises StateError
    naming a bad field); None when root holds no checkpoint. CheckpointError when root holds checkpoints and none
    is usable, or when the one to read keeps its state as a pickle and trust_pickled is off."""
    from safetensors.torch import load_file

    found = candidates(root)
    for ckpt in found:
        pickled = is_pickled(ckpt)
        if pickled and not trust_pickled:
            raise CheckpointError(
                f"{ckpt / PICKLED} holds the trainer state as a pickle (the format before tailrl stored it as "
                f"{STATE_JSON} + safetensors), and loading a pickle runs any code its writer put in it. Resume it "
                "only if you trust where this run folder came from, with trainer.trust_pickled_state=true (the "
                "state is then rewritten in the new format)")
        sharded = ckpt / "dcp" if (ckpt / "dcp").is_dir() else None
        f = ckpt / "model" / "model.safetensors"
        if not f.is_file() and (ckpt / "model" / "adapter_model.safetensors").is_file():
            f = ckpt / "model" / "adapter_model.safetensors"  # a LoRA run's: the adapter (PEFT's names), no base
        try:
            model = {} if sharded is not None else load_file(str(f))  # sharded: the weights load from dcp/
            if pickled:
                f = ckpt / PICKLED
                log.warning("trainer.trust_pickled_state=true: unpickling %s (this runs any code in it)", f)
                state = read_pickled_state(ckpt)
            else:
                f = ckpt / STATE_TENSORS
                tensors = load_file(str(f))
                f = ckpt / STATE_JSON
                state = read_state(ckpt, tensors)
            f = ckpt / "config.json"
            config = json.loads(f.read_text())
            f = ckpt / "drafter"
            got = Loaded(ckpt, model, state, config, load_drafter(f) if f.is_dir() else None, sharded)
        except Exception as e:  # truncated, corrupt or missing: any of them makes the checkpoint unusable
            log.warning("checkpoint %s is unusable (%s: %s: %s): trying the one before", ckpt.name, f,
                        type(e).__name__, _one_line(e, 200))
            continue
        try:
            if check is not None:
                check(got)
        except StateError as e:
            log.warning("checkpoint %s is unusable (%s): trying the one before", ckpt.name, _one_line(e, 300))
            continue
        if pickled:
            _convert(ckpt, state)
        return got
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoints in {root} is usable (the warnings above say "
                              "why): remove or repair them, or start this run afresh with trainer.overwrite=true")
    return None


def _one_line(e: Exception, n: int) -> str:
    return " ".join(str(e).split())[:n]


def _convert(ckpt: Path, state: dict) -> None:
    try:
        convert_pickled(ckpt, state)
    except (OSError, SafetensorError, TypeError) as e:
        log.warning("could not rewrite %s in the new format (%s): the next resume needs "
                    "trainer.trust_pickled_state=true again", ckpt / PICKLED, e)
        return
    log.warning("rewrote the trainer state of %s as %s + safetensors (the pickle is removed)", ckpt, STATE_JSON)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def config_changes(saved: dict, now: dict) -> list[str]:
    """'key: old -> new' for every config value that differs from the checkpoint's (resume/overwrite aside)."""
    a, b = _flat(saved), _flat(now)
    skip = {"trainer.resume", "trainer.overwrite", "trainer.trust_pickled_state"}
    return [f"{k}: {a.get(k, '(unset)')!r} -> {b.get(k, '(unset)')!r}" for k in sorted(a.keys() | b.keys())
            if k not in skip and a.get(k) != b.get(k)]
