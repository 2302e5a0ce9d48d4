"""Sharded checkpoints of the actor (torch.distributed.checkpoint, DCP): each rank writes its shards of the fp32
master weights and of AdamW's moments into `<checkpoint>/dcp/`; any world size reads them back (DCP reshards
by the global shapes in its metadata), one process included (2 ranks -> 1, 4 -> 2).

Invariants:
- Reading runs no code from the folder. DCP keeps its metadata (`.metadata`) as a pickle: it is read here with
  an unpickler that builds only DCP's own metadata records, torch sizes and dtypes (`SafeReader`), so a crafted
  file fails to load instead of running code; and only tensors are saved (the optimizer's hyper-parameters are
  the config's, restored on resume), so DCP's pickled "bytes" entries never occur (`SafePlanner` refuses them).
- The state saved is {"model": parameters by HF name, "optim": {"state": AdamW moments by parameter name}}:
  names, not positions, so FSDP's and the one-process optimizer read the same files. Only trained parameters are
  saved: a LoRA run's dcp/ holds its adapters (module names, `...q_proj.lora_A.default.weight`) and their moments."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from .state_io import StateError

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("pathlib", "PosixPath"),
     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata: refusing to load it")


def read_metadata(folder: Path):
    """DCP's metadata of a sharded checkpoint folder, unpickled with the allow-list above."""
    with open(Path(folder) / ".metadata", "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def _reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_metadata(self.path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader(str(folder))


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise StateError(read_item.dest_index.fqn, "a pickled entry in a sharded checkpoint (tailrl saves tensors only)")

    return SafePlanner()


def _no_dist() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _frozen(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _options(model=None):
    """The trained tensors only: a LoRA policy's frozen base is not in its checkpoint (full fine-tuning has no frozen
    parameter, so this changes nothing there). Loading a model with a frozen part: not strict, since the base is not
    in the state to load (every trained tensor is: DCP's planner fails on one the checkpoint lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=model is None or not _frozen(model))


def _states(model, optimizer, with_optimizer: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"model": get_model_state_dict(model, options=_options())}
    if _frozen(model):  # a frozen tied LM head under its second name stays in: drop it too
        trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        out["model"] = {k: v for k, v in out["model"].items() if k in trained}
    if with_optimizer:
        out["optim"] = {"state": get_optimizer_state_dict(model, optimizer, options=_options())["state"]}
    return out


def save_sharded(folder: Path, model, optimizer, with_optimizer: bool = True) -> None:
    """Every rank calls it (collective); each writes its shards into folder."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_states(model, optimizer, with_optimizer), checkpoint_id=str(folder), no_dist=_no_dist())


def has_optimizer(folder: Path) -> bool:
    return any(k.startswith("optim.") for k in read_metadata(folder).state_dict_metadata)


def load_sharded(folder: Path, model, optimizer) -> bool:
    """Reads folder into model (and optimizer, when the checkpoint holds its state): every rank calls it.
    Returns whether the optimizer's state was there."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_state_dict

    with_opt = has_optimizer(folder)
    sd = _states(model, optimizer, with_opt)
    dcp.load(sd, storage_reader=_reader(folder), planner=_planner(), no_dist=_no_dist())
    osd = None
    if with_opt:
        osd = {"state": sd["optim"]["state"],
               "param_groups": get_optimizer_state_dict(model, optimizer, options=_options())["param_groups"]}
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=osd or {},
                   options=_options(model))
    return with_opt


def check_sharded(folder: Path, shapes: dict) -> None:
    """The checkpoint's model tensors against the live model's {name: shape}: a StateError names the first
    missing, extra or misshapen one (so the caller falls back to the checkpoint before)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        md = read_metadata(folder)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise StateError(".metadata", f"does not load ({type(e).__name__}: {e})") from None
    saved = {k.removeprefix("model."): v for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    for name, shape in shapes.items():
        v = saved.get(name)
        if not isinstance(v, TensorStorageMetadata):
            raise StateError(f"model.{name}", "missing")
        if tuple(v.size) != tuple(shape):
            raise StateError(f"model.{name}", f"shape {tuple(v.size)} where {tuple(shape)} was expected")
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise StateError(f"model.{extra[0]}", "not a parameter of the model")
    bad = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
    if bad:
        raise StateError(bad[0], "a pickled entry (tailrl saves tensors only)")
