"""The trainer state on disk in forms that load without running code: `trainer_state.json` (plain JSON: step,
data position, Python RNG, history index, optimizer settings) and `trainer_state.safetensors` (every tensor:
optimizer moments, the torch RNG, the drafter trainer's weights and moments).

Invariants:
- Reading a state never unpickles: JSON and safetensors make only dicts, lists, numbers, strings and tensors.
  The one pickle loader left (`read_pickled_state`, today's old `trainer_state.pt`) is called only when the user
  said they trust the folder (`trainer.trust_pickled_state=true`).
- In the JSON a tensor is `{"$tensor": name}` (its name in the safetensors file) and a dict with int keys (an
  optimizer's per-parameter state) is `{"$int_keys": {...}}`; tuples come back as lists. Nothing else is tagged.
- `trainer_state.json` is written last: a folder holding it holds the whole state (a conversion cut off midway
  leaves the old file in charge)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
PICKLED = "trainer_state.pt"  # the format before issue 36: torch.save of the state dict (a pickle)
FORMAT = 2
_INT = re.compile(r"-?[0-9]+")


class StateError(ValueError):
    """A field of a trainer state that is missing or malformed; `field` names it (dotted path)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


def encode(value, tensors: dict, path: str = ""):
    """value as plain JSON; its tensors go into `tensors` under their path ('optimizer/state/0/exp_avg')."""
    def sub(k) -> str:
        return f"{path}/{k}" if path else str(k)

    if isinstance(value, torch.Tensor):
        tensors[path] = value
        return {"$tensor": path}
    if isinstance(value, dict):
        if value and all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {"$int_keys": {str(k): encode(v, tensors, sub(k)) for k, v in value.items()}}
        bad = [k for k in value if not isinstance(k, str) or k.startswith("$")]
        if bad:
            raise TypeError(f"trainer state {path or '/'}: key {bad[0]!r} is neither all-int nor a plain string")
        return {k: encode(v, tensors, sub(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v, tensors, sub(i)) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"trainer state {path or '/'}: a {type(value).__name__} has no plain form")


def decode(obj, tensors: dict, field: str = ""):
    """The inverse of encode; a dangling tensor name or a malformed tag is a StateError naming the field."""
    name = field or "(top)"

    def sub(k) -> str:
        return f"{field}.{k}" if field else str(k)

    if isinstance(obj, dict):
        if "$tensor" in obj:
            key = obj["$tensor"]
            if len(obj) != 1 or not isinstance(key, str):
                raise StateError(name, "a malformed tensor reference")
            if key not in tensors:
                raise StateError(name, f"tensor {key!r} is not in {STATE_TENSORS}")
            return tensors[key]
        if "$int_keys" in obj:
            items = obj["$int_keys"]
            if len(obj) != 1 or not isinstance(items, dict) or not all(_INT.fullmatch(k) for k in items):
                raise StateError(name, "a malformed int-keyed dict")
            return {int(k): decode(v, tensors, sub(k)) for k, v in items.items()}
        return {k: decode(v, tensors, sub(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, tensors, sub(i)) for i, v in enumerate(obj)]
    return obj


def _plain_tensors(tensors: dict) -> dict:
    """Contiguous CPU tensors with no storage shared (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for k, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.numel() == 0:
            t = t.clone()
        seen.add(ptr)
        out[k] = t
    return out


def write_state(folder: Path, state: dict) -> None:
    """The state as trainer_state.safetensors + trainer_state.json (the JSON last, each replaced atomically)."""
    tensors: dict = {}
    doc = {"format": FORMAT, "state": encode(state, tensors)}
    tmp = folder / (STATE_TENSORS + ".tmp")
    save_file(_plain_tensors(tensors), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / STATE_TENSORS)
    tmp = folder / (STATE_JSON + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, folder / STATE_JSON)


def read_state(folder: Path, tensors: dict | None = None) -> dict:
    """The state write_state wrote (tensors: its safetensors file, when already read); runs no code from the
    files. OSError/SafetensorError/ValueError on a file that does not load, StateError on a malformed document."""
    doc = json.loads((folder / STATE_JSON).read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("state"), dict):
        raise StateError("format", f"{STATE_JSON} is not a tailrl trainer state of format {FORMAT}")
    return decode(doc["state"], load_file(str(folder / STATE_TENSORS)) if tensors is None else tensors)


def is_pickled(folder: Path) -> bool:
    """A checkpoint in the old format: its trainer state is a pickle only (no trainer_state.json)."""
    return (folder / PICKLED).is_file() and not (folder / STATE_JSON).is_file()


def read_pickled_state(folder: Path) -> dict:
    """The old format. UNSAFE: unpickling runs whatever code the file's writer put in it; called only with
    trainer.trust_pickled_state=true."""
    state = torch.load(folder / PICKLED, map_location="cpu", weights_only=False)
    if not isinstance(state, dict):
        raise StateError("(top)", f"{PICKLED} holds a {type(state).__name__}, not a dict")
    return state


def convert_pickled(folder: Path, state: dict) -> None:
    """Rewrites an old checkpoint's state in the new format and removes the pickle."""
    write_state(folder, state)
    (folder / PICKLED).unlink(missing_ok=True)
