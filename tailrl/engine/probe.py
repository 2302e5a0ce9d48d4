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

from ..model import paged_attention
from ..model.chunked import CHUNK, QUERY_BLOCK, ROW_TILE, kernel, kernel_split, tiled_linear
from ..model.llama import CausalLM
from ..model.packed import linear_packed, pack_weight
from ..model.step import invariant_in_place, make_step
from .kv_cache import KVCache
from .probe_data import PAIRED, cancelling_keys, cancelling_product
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
           c.vocab_size, c.num_hidden_layers, model.dtype, str(model.device), torch.get_num_threads(),
           invariant_in_place(model.device))
    if key not in _CACHE:
        t = time.perf_counter()
        with torch.inference_mode():
            products = _products(model)
            calls = _call_rows(products)
            ProbeResult(True, call_rows=calls).apply(model)
            attention = _in_place_rows(model) if invariant_in_place(model.device) else _attention_items(model)
            failed = _linear_rows(products) + attention + _sampler_rows(model.device)
            del products
            if not failed:  # the end-to-end check would only restate a failure found above
                failed = _end_to_end(model)
        _CACHE[key] = ProbeResult(not failed, failed, time.perf_counter() - t, calls)
    _CACHE[key].apply(model)
    return _CACHE[key]


CALL_MAX = 256  # the largest product call checked (the LM head's: 64)


class _Product:
    """A layer's product with the probe's weight (engine/probe_data.py): the layer's shape, dtype, bias and calls,
    through the kernel the invariant passes run (oneDNN's packed product where it packs this dtype on a CPU,
    model/packed.py)."""

    def __init__(self, mod: torch.nn.Linear, weight: torch.Tensor):
        self.weight, self.call_rows = weight, getattr(mod, "call_rows", 0)
        self.bias = None if mod.bias is None else torch.zeros_like(mod.bias)
        self.packed = pack_weight(weight) if weight.device.type == "cpu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return linear_packed(x, self.packed, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _products(model: CausalLM) -> list:
    """(name, layer, its probe product, x [CALL_MAX rows, K]; the LM head's 96) per distinct weight shape, on
    cancelling data: what `_call_rows` and `_linear_rows` check."""
    g = torch.Generator(device="cpu").manual_seed(4)
    out, seen = [], set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.shape not in seen:
            seen.add(mod.weight.shape)
            x, w = cancelling_product(mod.weight.detach(), CALL_MAX if mod.out_features <= 8192 else 96, g)
            out.append((name, mod, _Product(mod, w), x))
    return out


def _call_rows(products: list) -> dict:
    """Per distinct weight shape, the largest call (a whole number of tiles, up to CALL_MAX rows; the LM head's up to
    64) such that in a call of every size up to it, every tile's product has the bits of the tile's own call, on
    cancelling data (engine/probe_data.py: on random data another order of summation hides). Measured with random
    data: on an Intel CPU with AMX (torch 2.11) a product of 1,536 inner columns held up to 144 rows; on an Emerald
    Rapids with torch 2.13, 32-80 rows by shape, while the passes still rounded otherwise (issue 45)."""
    calls = {}
    for _, mod, prod, x in products:
        top = CALL_MAX if mod.out_features <= 8192 else 4 * ROW_TILE  # the LM head: costly, and few rows a pass
        tiles = [prod(x[i : i + ROW_TILE]) for i in range(0, top, ROW_TILE)]
        ok = ROW_TILE
        for m in range(2 * ROW_TILE, top + 1, ROW_TILE):
            y = prod(x[:m])
            if not all(torch.equal(y[j * ROW_TILE : (j + 1) * ROW_TILE], t) for j, t in enumerate(tiles[: m // ROW_TILE])):
                break
            ok = m
        calls[tuple(mod.weight.shape)] = ok
    return calls


def _linear_rows(products: list) -> list[str]:
    """Each distinct weight shape: a row's product is the same in a tile of its own, among other rows, at every other
    place in its tile, and in a pass of several tiles (in the calls `_call_rows` chose), on cancelling data."""
    failed = []
    for name, mod, prod, x in products:
        prod.call_rows = getattr(mod, "call_rows", 0)
        x = x[: 5 * ROW_TILE + 3]
        ref = tiled_linear(prod, x[:1], ROW_TILE)
        tile = tiled_linear(prod, x[:ROW_TILE], ROW_TILE)
        passes = {"alone in its tile": ref, "among other rows": tile[:1],
                  "at the end of its tile": tiled_linear(prod, torch.cat([x[1:ROW_TILE], x[:1]]), ROW_TILE)[-1:],
                  "in a pass of 6 tiles": tiled_linear(prod, torch.cat([x[1:], x[:1]]), ROW_TILE)[-1:]}
        # every row of a tile at another place, beside other neighbours: the tile reversed and rolled
        flips = {"at another place in its tile (reversed)": tiled_linear(prod, x[:ROW_TILE].flip(0), ROW_TILE).flip(0),
                 "at another place in its tile (rolled)": tiled_linear(prod, x[:ROW_TILE].roll(5, 0), ROW_TILE).roll(-5, 0)}
        if mod.out_features <= 8192:  # a layer's products (not the LM head: costly) also at a verify pass's 17 tiles
            wide = torch.cat([x[1:], x[1:], x[1:], x[1:26], x[:1]])  # 272 rows
            passes["in a pass of 17 tiles"] = tiled_linear(prod, wide, ROW_TILE)[-1:]
        bad = [w for w, y in passes.items() if not torch.equal(y, ref)]
        bad += [w for w, y in flips.items() if not torch.equal(y, tile)]
        if bad:
            failed.append(f"linear {mod.in_features}->{mod.out_features} ({name}): a row's product differs {bad[0]}")
    return failed


def _attention_items(model: CausalLM) -> list[str]:
    """A kernel item (QUERY_BLOCK query tokens of `heads` query heads x CHUNK keys, model/chunked.py `kernel_split`)
    gives the same bits in a call of 1 or many items, with other query rows beside it, at another row of its block,
    and as each block of an item of 2..fold blocks (the blocks of one sequence that read the same chunk share an
    item), on cancelling keys (engine/probe_data.py) that rows see in whole groups."""
    c = model.config
    group, kvh, D = c.num_attention_heads // c.num_key_value_heads, c.num_key_value_heads, c.head_dim
    heads, fold = kernel_split(group)
    H, R, n = kvh * group // heads, heads * QUERY_BLOCK, 9  # kernel heads (each reads its K/V head), rows a block
    g = torch.Generator(device="cpu").manual_seed(1)
    dev, dt = model.device, model.dtype
    q = torch.randn(n, H, fold * R, D, generator=g).to(dev, dt)
    k, v = (t.to(dev, dt) for t in cancelling_keys(n, kvh, D, g))
    where = f"attention item ({R} rows x {CHUNK} keys)"

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def run(qq, mask):
        return kernel(qq, k[: qq.shape[0]], v[: qq.shape[0]], mask)

    mask = torch.zeros(n, 1, R, CHUNK, dtype=torch.bool, device=dev)
    mask[..., : CHUNK // 2 + PAIRED] = True
    ref = run(q[:1, :, :R], mask[:1])
    many = run(q[:, :, :R], mask)
    if not same((many[0][:1], many[1][:1]), ref):
        return [f"{where}: a row differs in a call of many items"]
    other = q[:1, :, :R].clone()
    other[:, :, 1:] = torch.randn(1, H, R - 1, D, generator=g).to(dev, dt)
    if not torch.equal(run(other, mask[:1])[0][:, :, :1], ref[0][:, :, :1]):
        return [f"{where}: a row differs beside other query rows"]
    if not torch.equal(run(q[:1, :, :R].roll(1, 2), mask[:1])[0][:, :, 1:2], ref[0][:, :, :1]):
        return [f"{where}: a row differs at another place in its block"]
    seen = PAIRED * torch.randint(1, CHUNK // PAIRED + 1, (n, 1, fold * R, 1), generator=g).to(dev)
    mf = torch.arange(CHUNK, device=dev) < seen  # every row sees its own prefix of the chunk, as causal rows do
    alone = [run(q[:, :, b * R : (b + 1) * R], mf[:, :, b * R : (b + 1) * R]) for b in range(fold)]
    for m in range(2, fold + 1):
        o, lse = run(q[:, :, : m * R], mf[:, :, : m * R])
        if not all(same((o[:, :, b * R : (b + 1) * R], lse[:, :, b * R : (b + 1) * R]), alone[b]) for b in range(m)):
            return [f"{where}: a block's rows differ in an item of {m} blocks"]
    return []


def _in_place_rows(model: CausalLM) -> list[str]:
    """Our kernel (model/paged_attention.py) gives a row the same bits decoded alone, as a row of a causal prefill
    beside another sequence (its rows in items of the kernel's QBLOCK tokens), as the last row of its whole prompt's
    prefill, and as a draft tree's root under a mask, on cancelling keys (engine/probe_data.py) the row sees in
    whole groups: what the kernel promises by construction, checked on the build this process loaded."""
    c = model.config
    kvh, H, D, dev, dt = c.num_key_value_heads, c.num_attention_heads, c.head_dim, model.device, model.dtype
    g = torch.Generator(device="cpu").manual_seed(5)
    k, v = cancelling_keys(2, kvh, D, g)  # [2 sequences, kv heads, CHUNK, D]
    per = CHUNK // 16
    pools = [t.transpose(0, 1).reshape(kvh, 2 * per, 16, D).to(dev, dt).contiguous() for t in (k, v)]
    table = torch.arange(2 * per, device=dev).view(2, per)
    P = CHUNK - 7 * PAIRED  # the row at position P - 1 sees P keys: whole groups
    q = torch.randn(2, P, H, D, generator=g).to(dev, dt)
    where = "attention rows (our kernel, in place)"

    def run(rows, slots, lens, mask=None):
        lens = torch.tensor(lens, device=dev)
        mask = None if mask is None else mask.to(dev)
        return paged_attention.paged_attention(rows, *pools, table, torch.tensor(slots, device=dev), mask, lens)

    alone = run(q[:1, P - 1 :], [0], [[P - 1, 1]])[0, 0]
    block = run(torch.stack([q[0, P - 20 :], q[1, :20]]), [0, 1], [[P - 20, 20], [0, 20]])[0, -1]
    whole = run(torch.stack([q[1], q[0]]), [1, 0], [[0, 37], [0, P]])[1, -1]
    tree = torch.zeros(2, 6, P + 5, dtype=torch.bool)  # slot 0: a chain of 5 drafts on its root; slot 1: 3 rows
    for i in range(6):
        tree[0, i, : P + i] = True
        tree[1, i, : 41 + i] = i < 3
    rows = torch.zeros_like(q[:, :6])
    rows[0, 0], rows[0, 1:], rows[1, :3] = q[0, P - 1], q[0, :5], q[1, :3]
    verify = run(rows, [0, 1], [[P - 1, 6], [40, 3]], tree)[0, 0]
    cases = {"as a causal prefill's row beside another sequence": block, "as its prompt's last prefill row": whole,
             "as a draft tree's root under a mask": verify}
    bad = [w for w, o in cases.items() if not torch.equal(o, alone)]
    return [f"{where}: a row decoded alone differs {bad[0]}"] if bad else []


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
    tests/engine/test_invariant.py's prefill test: on an Intel CPU with AMX at 2 threads (torch 2.11) a prompt prefilled
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
