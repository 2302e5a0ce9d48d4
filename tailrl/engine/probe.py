"""The start-up probe of batch invariance: checks, on the kernels this process runs, every property the invariant
passes rely on (engine/invariant.py), at the shapes the engine really uses, and names the first that fails.

The passes fix every call's shape class by construction (model/chunked.py): matrix products on whole row tiles,
attention items of fixed query rows and keys, a scalar merge. What construction cannot promise is that a kernel of
one fixed shape treats all its rows alike (a row's bits independent of its place in the tile and of the rows
beside it) and that a call's batch count does not change an item. Those are checked here, and then the property
itself end to end on the model: a token decoded alone, decoded beside other sequences and a draft tree, and
prefilled with its prompt, gives the same logits bit for bit.

It runs once per process and model shape (a few forwards of about CHUNK tokens; well under a second on a 2-core
CPU for SmolLM2-135M) and its verdict is cached."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..model.chunked import CHUNK, FOLD, QUERY_BLOCK, ROW_TILE, kernel, tiled_linear
from ..model.llama import CausalLM
from ..model.step import make_step
from .kv_cache import KVCache
from .sampler import warped_logprobs

log = logging.getLogger(__name__)


@dataclass
class ProbeResult:
    ok: bool
    failed: list[str] = field(default_factory=list)  # the properties that did not hold, named
    seconds: float = 0.0
    call_rows: dict = field(default_factory=dict)  # weight shape -> the largest product call whose tiles held

    def apply(self, model: CausalLM) -> None:
        """Gives each linear layer its call size (model/chunked.py `in_calls`; 0: one call)."""
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.call_rows = self.call_rows.get(tuple(mod.weight.shape), 0)

    def summary(self) -> str:
        return "holds" if self.ok else "fails: " + "; ".join(self.failed)


_CACHE: dict[tuple, ProbeResult] = {}


def probe_invariance(model: CausalLM) -> ProbeResult:
    """The verdict for this model's shapes, dtype and device under this process's kernels and thread count."""
    c = model.config
    key = (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
           c.vocab_size, c.num_hidden_layers, model.dtype, str(model.device), torch.get_num_threads())
    if key not in _CACHE:
        t = time.perf_counter()
        with torch.inference_mode():
            calls = _call_rows(model)
            ProbeResult(True, call_rows=calls).apply(model)
            failed = _linear_rows(model) + _attention_items(model) + _sampler_rows(model.device)
            if not failed:  # the end-to-end check would only restate a failure found above
                failed = _end_to_end(model)
        _CACHE[key] = ProbeResult(not failed, failed, time.perf_counter() - t, calls)
    _CACHE[key].apply(model)
    return _CACHE[key]


CALL_MAX = 256  # the largest product call checked (the LM head's: 64)


def _call_rows(model: CausalLM) -> dict:
    """Per distinct weight shape, the largest call (a whole number of tiles, up to CALL_MAX rows) such that in a call
    of every size up to it, every tile's product has the bits of the tile's own call. Measured on an Intel CPU with
    AMX (oneDNN, torch 2.11): a product of 1,536 inner columns held up to 144 rows and one of 4,864 up to 16-32;
    on an AMD Zen 4 every shape held at every size checked."""
    g = torch.Generator(device="cpu").manual_seed(4)
    calls = {}
    for mod in model.modules():
        shape = tuple(mod.weight.shape) if isinstance(mod, torch.nn.Linear) else None
        if shape is None or shape in calls:
            continue
        top = CALL_MAX if mod.out_features <= 8192 else 4 * ROW_TILE  # the LM head: costly, and few rows a pass
        x = torch.randn(top, mod.in_features, generator=g).to(model.device, model.dtype)
        tiles = [mod(x[i : i + ROW_TILE]) for i in range(0, top, ROW_TILE)]
        ok = ROW_TILE
        for m in range(2 * ROW_TILE, top + 1, ROW_TILE):
            y = mod(x[:m])
            if not all(torch.equal(y[j * ROW_TILE : (j + 1) * ROW_TILE], t) for j, t in enumerate(tiles[: m // ROW_TILE])):
                break
            ok = m
        calls[shape] = ok
    return calls


def _linear_rows(model: CausalLM) -> list[str]:
    """Each distinct weight shape: a row's product is the same in a tile of its own, among other rows, at another
    place in its tile, and in a pass of several tiles (in the calls `_call_rows` chose)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    seen, failed = set(), []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or mod.weight.shape in seen:
            continue
        seen.add(mod.weight.shape)
        x = torch.randn(5 * ROW_TILE + 3, mod.in_features, generator=g).to(model.device, model.dtype)
        ref = tiled_linear(mod, x[:1], ROW_TILE)
        passes = {"alone in its tile": ref, "among other rows": tiled_linear(mod, x, ROW_TILE)[:1],
                  "at the end of its tile": tiled_linear(mod, torch.cat([x[1:ROW_TILE], x[:1]]), ROW_TILE)[-1:],
                  "in a pass of 6 tiles": tiled_linear(mod, torch.cat([x[1:], x[:1]]), ROW_TILE)[-1:]}
        if mod.out_features <= 8192:  # a layer's products (not the LM head: costly) also at a verify pass's 17 tiles
            wide = torch.cat([x[1:], x[1:], x[1:], x[1:26], x[:1]])  # 272 rows
            passes["in a pass of 17 tiles"] = tiled_linear(mod, wide, ROW_TILE)[-1:]
        for where, y in passes.items():
            if not torch.equal(y, ref):
                failed.append(f"linear {mod.in_features}->{mod.out_features} ({name}): a row's product differs "
                              f"{where}")
                break
    return failed


def _attention_items(model: CausalLM) -> list[str]:
    """A kernel item (QUERY_BLOCK query tokens x CHUNK keys) gives the same bits in a call of 1 or many items, with
    other query rows beside it, at another row of its block, and as one block of an item of 2..FOLD blocks (the
    blocks of one sequence that read the same chunk share an item, model/chunked.py)."""
    c = model.config
    group, kvh, D = c.num_attention_heads // c.num_key_value_heads, c.num_key_value_heads, c.head_dim
    R, n = group * QUERY_BLOCK, 9
    g = torch.Generator(device="cpu").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(model.device, model.dtype)

    q, k, v = rand(n, kvh, R, D), rand(n, kvh, CHUNK, D), rand(n, kvh, CHUNK, D)
    mask = torch.zeros(n, 1, R, CHUNK, dtype=torch.bool, device=model.device)
    mask[..., : CHUNK // 2 + 7] = True
    ref, ref_lse = kernel(q[:1], k[:1], v[:1], mask[:1])
    checks = {"in a call of many items": kernel(q, k, v, mask)}
    other = q.clone()
    other[:, :, 1:] = rand(n, kvh, R - 1, D)
    checks["beside other query rows"] = kernel(other, k, v, mask)
    for where, (o, lse) in checks.items():
        if not (torch.equal(o[:1, :, :1], ref[:, :, :1]) and torch.equal(lse[:1, :, :1], ref_lse[:, :, :1])):
            return [f"attention item ({R} rows x {CHUNK} keys): a row differs {where}"]
    moved = q[:1].roll(1, 2)  # row 0 now sits at row 1 of its block
    o, _ = kernel(moved, k[:1], v[:1], mask[:1])
    if not torch.equal(o[:, :, 1:2], ref[:, :, :1]):
        return [f"attention item ({R} rows x {CHUNK} keys): a row differs at another place in its block"]
    qf = rand(n, kvh, FOLD * R, D)
    mf = torch.arange(CHUNK, device=model.device) < torch.randint(1, CHUNK, (n, 1, FOLD * R, 1), generator=g).to(
        model.device)  # every row sees its own prefix of the chunk, as causal rows do
    for m in range(2, FOLD + 1):
        o, lse = kernel(qf[:, :, : m * R], k, v, mf[:, :, : m * R])
        for b in (0, m - 1):
            rows = slice(b * R, (b + 1) * R)
            o1, lse1 = kernel(qf[:, :, rows], k, v, mf[:, :, rows])
            if not (torch.equal(o[:, :, rows], o1) and torch.equal(lse[:, :, rows], lse1)):
                return [f"attention item ({R} rows x {CHUNK} keys): a block's rows differ in an item of {m} blocks"]
    return []


def _sampler_rows(device) -> list[str]:
    g = torch.Generator(device="cpu").manual_seed(2)
    logits = (3 * torch.randn(40, 4096, generator=g)).to(device)
    temps = torch.linspace(0.5, 1.5, 40, device=device)
    top_p = torch.full((40,), 0.9, device=device)
    top_p[36] = 1.0  # a row without top-p beside rows with it
    alone = warped_logprobs(logits[35:36], temps[35:36], None, top_p[35:36])
    batch = warped_logprobs(logits, temps, None, top_p)
    if not torch.equal(batch[35:36], alone):
        return ["sampler: a row's warped logprobs differ inside a batch"]
    if not torch.equal(batch[36:37], warped_logprobs(logits[36:37], temps[36:37], None, None)):
        return ["sampler: a row without top-p is cut beside rows with it"]
    return []


def _end_to_end(model: CausalLM) -> list[str]:
    """A prompt of CHUNK + 40 tokens (its keys span two chunks): its last token's logits from the prefill alone, from
    its prefill beside another prompt (prompts admitted together prefill in one pass), from a decode pass alone, and
    from a decode pass beside two other sequences, one verifying a draft tree. The prompts are those of
    tests/test_invariant.py's prefill test: on an Intel CPU with AMX at 2 threads (torch 2.11) a prompt prefilled
    beside another gave other bits than alone while every check at shorter prefills held (benchmarks/RESULTS.md,
    session 19)."""
    c = model.config
    g = torch.Generator(device="cpu").manual_seed(3)
    P = CHUNK + 40
    ids = torch.randint(0, c.vocab_size, (P + 40,), generator=g).tolist()
    kv = KVCache(c, 0, model.device, model.dtype)
    kv.layout(3, 2 * CHUNK)
    dev = model.device

    def run(tokens, cache_lens, q_lens, slots, parents=None, last=None):
        step = make_step(cache_lens, q_lens, slots, dev, invariant=True,
                         tree_parents=None if parents is None else torch.tensor(parents, device=dev))
        idx = None if last is None else torch.tensor(last, device=dev)
        return model(torch.tensor(tokens, device=dev), step, kv, logits_idx=idx)[0]

    prefilled = run(ids[:P], [0], [P], [0], last=[P - 1])
    together = run(ids[P:P + 30] + ids[:P], [0, 0], [30, P], [1, 0], last=[30 + P - 1])
    run(ids[P:P + 20] + ids[P + 20:P + 40], [0, 0], [20, 20], [1, 2])
    alone = run(ids[P - 1:P], [P - 1], [1], [0])
    tree = [ids[P - 1], *ids[P + 30:P + 36], ids[P + 19]]  # slot 0's root, slot 1's tree of 6, slot 2's root
    beside = run(tree, [P - 1, 20, 20], [1, 6, 1], [0, 1, 2], parents=[[0] * 6, [0, 0, 1, 1, 2, 0], [0] * 6])
    if not torch.equal(together, prefilled):
        return ["end to end: a prompt prefilled beside another prompt differs from it prefilled alone"]
    if not torch.equal(alone, prefilled):
        return ["end to end: a token decoded alone differs from the same token in its prompt's prefill"]
    if not torch.equal(beside[:1], alone):
        return ["end to end: a token decoded beside other sequences and a draft tree differs from it decoded alone"]
    return []


def resolve_invariant(setting: bool | str, model: CausalLM) -> tuple[bool, ProbeResult | None]:
    """engine.batch_invariant: true | false | auto. auto: bf16/fp16 on a CPU, when the probe passes (fp32 rounds
    apart only at near-ties, and CUDA needs `true`); true: anywhere, and an error naming the property the probe
    found broken. Returns (run the invariant passes, the probe's verdict or None when it did not run)."""
    reduced = model.dtype in (torch.bfloat16, torch.float16)
    if setting is False or (setting == "auto" and not (reduced and model.device.type == "cpu")):
        return False, None
    result = probe_invariance(model)
    if setting is True and not result.ok:
        raise RuntimeError(f"batch_invariant=true, but on this machine's kernels the invariant passes do not hold: "
                           f"{result.summary()}. Use batch_invariant=auto (SD on and off then draw from the same "
                           f"distribution, not the same tokens) or other kernels (ONEDNN_MAX_CPU_ISA).")
    if not result.ok:
        log.warning("batch invariance %s: SD on and off draw from the same distribution, not the same tokens "
                    "(rollout/batch_invariant = 0)", result.summary())
    return result.ok, result
