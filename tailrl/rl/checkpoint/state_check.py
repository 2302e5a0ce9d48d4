"""A checkpoint is checked before it is trusted: its fields against the trainer that will take them (issue 36).

`check_checkpoint` raises StateError naming the first field that is missing or malformed (a key, a type, a
shape against the model and the config), so that the caller can fall back to the checkpoint before. It checks
everything `Trainer.resume` reads, so that applying a checked state cannot fail half way (a policy loaded, its
optimizer refused). Parts of the state that resume ignores (a drafter trainer's state when this run trains no
drafter) are not checked."""

from __future__ import annotations

import random

import torch

from .state_io import StateError

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")  # the trainer's optimizers are AdamW (precision.make_adamw)
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "params")  # what AdamW's step reads from a group
STATE_KEYS = ("step", "optimizer", "loader", "python_rng", "torch_rng", "history", "drafter")
DRAFTER_KEYS = ("fc", "layer", "vocab", "optimizer", "sched", "steps")


def _shape(t) -> str:
    return f"({', '.join(map(str, t))})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _join(field: str, key) -> str:
    return f"{field}.{key}" if field else str(key)


def _need(d: dict, key: str, field: str):
    if not isinstance(d, dict):
        raise StateError(field or "(top)", f"a {type(d).__name__} where a dict was expected")
    if key not in d:
        raise StateError(_join(field, key), "missing")
    return d[key]


def _count(v, field: str) -> int:
    if not _is_int(v) or v < 0:
        raise StateError(field, f"{v!r} is not a non-negative integer")
    return v


def _int_list(v, field: str) -> None:
    if not isinstance(v, (list, tuple)) or not all(_is_int(x) for x in v):
        raise StateError(field, "not a list of integers")


def _like(saved, live, field: str) -> None:
    """saved is plain data of live's kind (numbers for numbers, flags for flags, lists of the same length)."""
    if live is None or isinstance(live, bool):
        ok = saved is None or isinstance(saved, bool) or (live is None and _is_num(saved))
    elif _is_num(live) or isinstance(live, torch.Tensor):
        ok = _is_num(saved) or (isinstance(saved, torch.Tensor) and saved.numel() == 1)
    elif isinstance(live, str):
        ok = isinstance(saved, str)
    elif isinstance(live, (list, tuple)):
        ok = isinstance(saved, (list, tuple)) and len(saved) == len(live)
        if ok:
            for i, (a, b) in enumerate(zip(saved, live)):
                _like(a, b, f"{field}.{i}")
    elif isinstance(live, dict):
        ok = isinstance(saved, dict) and saved.keys() == live.keys()
        if ok:
            for k in live:
                _like(saved[k], live[k], f"{field}.{k}")
    else:
        ok = True
    if not ok:
        raise StateError(field, f"{type(saved).__name__} {str(saved)[:60]} where {type(live).__name__} was expected")


def _tensor(t, shape, field: str, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise StateError(field, f"a {type(t).__name__} where a tensor was expected")
    if floating and not t.dtype.is_floating_point:
        raise StateError(field, f"dtype {t.dtype} where a floating-point tensor was expected")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise StateError(field, f"shape {_shape(t.shape)} where {_shape(shape)} was expected")


def check_tensors(saved, live: dict, field: str) -> None:
    """saved holds exactly live's names, each a floating tensor of live's shape (a module's state dict)."""
    if not isinstance(saved, dict):
        raise StateError(field or "(top)", f"a {type(saved).__name__} where a dict of tensors was expected")
    for k, t in live.items():
        _tensor(_need(saved, k, field), getattr(t, "shape", t), _join(field, k))
    extra = sorted(set(saved) - set(live))
    if extra:
        raise StateError(_join(field, extra[0]), "not a parameter of the model")


def check_optimizer(saved, live: torch.optim.Optimizer, field: str) -> None:
    """An AdamW state dict for live's parameters: its groups as live's, each moment in its parameter's shape."""
    groups = _need(saved, "param_groups", field)
    params = [p for g in live.param_groups for p in g["params"]]
    if not isinstance(groups, list) or len(groups) != len(live.param_groups):
        raise StateError(f"{field}.param_groups", f"not a list of {len(live.param_groups)} parameter groups")
    for i, (g, lg) in enumerate(zip(groups, live.param_groups)):
        f = f"{field}.param_groups.{i}"
        for k in GROUP_KEYS:
            _need(g, k, f)
        _int_list(g["params"], f + ".params")
        if len(g["params"]) != len(lg["params"]):
            raise StateError(f + ".params", f"{len(g['params'])} parameters where the model has {len(lg['params'])}")
        for k, v in g.items():
            if k in lg and k != "params":
                _like(v, lg[k], f"{f}.{k}")
    if sorted(i for g in groups for i in g["params"]) != list(range(len(params))):
        raise StateError(f"{field}.param_groups", f"its parameter ids are not 0..{len(params) - 1}, each once")
    state = _need(saved, "state", field)
    if not isinstance(state, dict):
        raise StateError(f"{field}.state", f"a {type(state).__name__} where a dict was expected")
    for i, s in state.items():
        f = f"{field}.state.{i}"
        if not _is_int(i) or not 0 <= i < len(params):
            raise StateError(f, f"no such parameter (the model has {len(params)})")
        for k in ADAM_KEYS:
            _need(s, k, f)
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                continue
            if not isinstance(v, torch.Tensor):
                if not _is_num(v):
                    raise StateError(f"{f}.{k}", f"a {type(v).__name__} where a tensor or number was expected")
                continue
            _tensor(v, params[i].shape, f"{f}.{k}")


def _check_rng(state: dict) -> None:
    rng = _need(state, "python_rng", "")
    if not isinstance(rng, (list, tuple)) or len(rng) != 3 or not isinstance(rng[1], (list, tuple)):
        raise StateError("python_rng", "not a (version, state, gauss) triple")
    try:
        random.Random().setstate(python_rng(rng))
    except (TypeError, ValueError, OverflowError) as e:
        raise StateError("python_rng", f"not a Python RNG state ({e})") from None
    live = torch.get_rng_state()
    t = _need(state, "torch_rng", "")
    _tensor(t, live.shape, "torch_rng", floating=False)
    if t.dtype != live.dtype:
        raise StateError("torch_rng", f"dtype {t.dtype} where {live.dtype} was expected")


def python_rng(saved) -> tuple:
    """random.setstate's triple from its JSON form (lists for tuples)."""
    version, inner, gauss = saved
    return version, tuple(inner), gauss


def _check_history(hist) -> None:
    if hist is None:
        return
    prompts = _need(hist, "prompts", "history")
    if not isinstance(prompts, list):
        raise StateError("history.prompts", "not a list")
    for i, item in enumerate(prompts):
        f = f"history.prompts.{i}"
        _int_list(_need(item, "prompt", f), f + ".prompt")
        if not isinstance(item.get("turn", 0), int) or item.get("turn", 0) < 0:
            raise StateError(f + ".turn", "not a turn number (an integer >= 0)")
        epochs = _need(item, "epochs", f)
        if not isinstance(epochs, list):
            raise StateError(f + ".epochs", "not a list")
        for j, epoch in enumerate(epochs):
            if not isinstance(epoch, list):
                raise StateError(f"{f}.epochs.{j}", "not a list of responses")
            for k, r in enumerate(epoch):
                _int_list(r, f"{f}.epochs.{j}.{k}")


def _check_partial(saved) -> None:
    """Partial rollouts' carried groups (absent or None: none): each response's tokens, logprobs and versions line up."""
    if saved is None:
        return
    from ...rollout.partial import PartialBuffer

    buf = PartialBuffer(1, 0)
    try:
        buf.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StateError("partial", f"malformed carried responses ({type(e).__name__}: {e})") from None
    for k, g in enumerate(buf.groups):
        for j, r in enumerate(g.responses):
            st = r.state
            mask = (getattr(st, "trajectory", None) or {}).get("mask", st.output_ids)  # a trajectory's: 1 a drawn token
            if len(r.versions) != len(r.tokens) or len({len(st.logprobs), len(st.output_ids), len(mask)}) > 1:
                raise StateError(f"partial.groups.{k}.responses.{j}", "tokens, logprobs and versions differ in length")


def _check_drafter(saved, trainer) -> None:
    if saved is None or trainer is None:  # resume ignores a drafter state this run has no trainer for
        return
    for k in DRAFTER_KEYS:
        _need(saved, k, "drafter")
    check_tensors(saved["fc"], trainer.model.fc.state_dict(), "drafter.fc")
    check_tensors(saved["layer"], trainer.model.layer.state_dict(), "drafter.layer")
    check_vocab(saved["vocab"], trainer.model.config.vocab_size, "drafter.vocab")
    check_optimizer(saved["optimizer"], trainer.opt, "drafter.optimizer")
    _like(saved["sched"], trainer.sched.state_dict(), "drafter.sched")
    _count(saved["steps"], "drafter.steps")


def check_vocab(v, vocab_size: int, field: str) -> None:
    """A draft vocabulary: token ids of the target, as a 1-D integer tensor (empty: the full vocabulary)."""
    _tensor(v, None, field, floating=False)
    if v.dim() != 1 or v.dtype not in (torch.int64, torch.int32):
        raise StateError(field, f"a {v.dim()}-D {v.dtype} tensor where 1-D token ids were expected")
    if len(v) and not (0 <= int(v.min()) and int(v.max()) < vocab_size):
        raise StateError(field, f"token ids outside the target's vocabulary (0..{vocab_size - 1})")


def check_state(state, step: int, optimizer, drafter_trainer=None) -> None:
    """The trainer state (trainer_state.*) against the live optimizer and drafter trainer; step is the folder's."""
    for k in STATE_KEYS:
        _need(state, k, "")
    if _count(state["step"], "step") != step:
        raise StateError("step", f"{state['step']} in a checkpoint folder of step {step}")
    loader = state["loader"]
    _count(_need(loader, "epoch", "loader"), "loader.epoch")
    _count(_need(loader, "index", "loader"), "loader.index")
    _check_rng(state)
    # None: saved without it (trainer.save_optimizer_final=false); no live optimizer: N ranks load it (they check it)
    if state["optimizer"] is not None and optimizer is not None:
        check_optimizer(state["optimizer"], optimizer, "optimizer")
    _check_history(state["history"])
    _check_drafter(state["drafter"], drafter_trainer)
    _check_partial(state.get("partial"))


def check_checkpoint(got, shapes: dict, optimizer, drafter_trainer=None, head=None, tied: bool = False) -> None:
    """Everything resume reads from `got` (a checkpoint.Loaded): weights, trainer state, config and drafter head.
    shapes: the live policy's {name: shape} named as this checkpoint saves them (Actor.shapes(dcp=...): dcp/ names a
    LoRA adapter's tensors as the module does, model.safetensors as PEFT does); optimizer: the live one, or None
    where its state is sharded (DCP checks its moments' shapes as it loads them); tied: the LM head is the embedding.
    The StateError's field is prefixed with the file it is in."""
    from .sharded_io import check_sharded

    live = dict(shapes)
    if tied and got.sharded is None:
        live.pop("lm_head.weight", None)  # saved once, as the embedding
    step = int(got.path.name.removeprefix("step_"))
    weights = (("dcp", lambda: check_sharded(got.sharded, live)) if got.sharded is not None
               else ("model.safetensors", lambda: check_tensors(got.model, live, "")))
    for name, check in (weights,
                        ("trainer_state", lambda: check_state(got.state, step, optimizer, drafter_trainer)),
                        ("config.json", lambda: _need(got.config, "trainer", "")),
                        ("drafter", lambda: _check_head(got.drafter, head))):
        try:
            check()
        except StateError as e:
            raise StateError(f"{name}: {e.field}".rstrip(": "), e.why) from None


def _check_head(saved, head) -> None:
    if saved is None or head is None:
        return
    check_tensors(saved.fc.state_dict(), head.fc.state_dict(), "fc")
    check_tensors(saved.layer.state_dict(), head.layer.state_dict(), "layer")
    check_vocab(saved.vocab, head.config.vocab_size, "vocab")
