"""The self-speculative drafter: the policy's own layers with weight-only quantized products (model/quant.py)
draft for the policy, so its drafts track the policy with no training and cannot go stale (EfficientRollout's
self-drafter; `rollout.spec.mode=self`, or `rollout.spec.self_draft=true` to offer it to `auto`'s selector).

It keeps no KV cache of its own: for every verified position it reads the target's K/V (exact, so no prefill and
no catch-up), and it computes only the draft positions, writing their K/V into the target's cache at the very
positions the verify pass then writes: the root's at cache_len, draft token k's at cache_len + k + 1. Every layer
of the verify pass writes all of its rows' K/V before it attends (model/llama.py forward_cached), and a sequence's
positions past its cache are its own (kv_rooms: blocks it holds; the block of cache_len is never a shared prefix
block, the verify pass writes there too), so nothing reads what a draft wrote but the draft's own next levels. A
shadow proposal (speculative/shadow.py) writes past the cache the same way, and the next pass overwrites it.

Drafts are chains, one quantized pass per level for all sequences at once. Greedy requests draft the argmax;
sampled ones (`coupled`, the default) draw draft token k as argmax of log q(x) + G(seed, position + k, x), with the
verifier's own keyed noise, so the verifier's walk emits plain decoding's tokens bit for bit and accepts wherever the
quantized model's Gumbel-max agrees with the policy's; with `coupled` off they draw from q on a noise stream of their
own and carry q for rejection sampling (speculative/verify.py).

Its weights are re-quantized whenever the engine starts a new batch (model/packed.py invalidate_packs: weights move
between rollouts, never during one), so after every weight sync it drafts with the new policy's weights."""

from __future__ import annotations

import time

import torch
from torch import nn

from ..model import packed
from ..model.packed import packed_linear
from ..model.quant import QLinear, quant_rows, quantize_linear
from ..model.rope import rope_cos_sin
from ..model.step import make_step
from .config import SpecConfig
from .noise import gumbel_argmax, row_keys, signed64
from .tree import DraftTree

DRAFT_SALT = 0x5E1F_D4AF_7000_0003  # its own draws (coupled off) keep clear of the verifier's noise stream


class SelfDrafter:
    name = "self"
    costly = True  # proposals cost forwards: shadow drafts run rarely
    needs_hidden = False
    policy_bound = False  # the policy itself, re-quantized at every new batch
    per_level = True  # a proposal costs one batched pass per draft level: the selector prices it so

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg
        self.chains = True  # always chains (the speculator sets it; a chain is what one pass per level drafts)
        self.model = None
        self.kv = None
        self.q: dict[nn.Module, QLinear] = {}  # the target's linear modules -> their quantized copies
        self.rows: dict[nn.Module, int] = {}  # -> the most rows their quantized kernel runs
        self.head_rows = 0
        self.max_rows: int | None = None  # every product quantized up to this many rows (None: quant_rows' table)
        self.head: QLinear | None = None
        self.head_dense: nn.Linear | None = None  # the draft vocabulary's rows in the target's dtype (wide passes)
        self.vocab: torch.Tensor | None = None  # draft vocabulary (target ids), None: all
        self.counts: torch.Tensor | None = None  # tokens seen (prompts and outputs): the draft vocabulary's choice
        self.key = None  # the weights' generation quantized from (model/packed.py)
        self.last_levels = 0  # batched passes of the last proposal
        self.quantize_s = 0.0  # seconds of the last re-quantization
        self.quantizations = 0

    # ---- protocol ---------------------------------------------------------------------------------------------

    def bind_target(self, model) -> None:
        self.model = model
        self.counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
        self.key = None

    def attach(self, kv) -> None:
        self.kv = kv

    def start(self, seq) -> None:
        if self.cfg.self_vocab and self.counts is not None:
            self.counts += torch.bincount(torch.tensor(seq.prompt_ids + seq.output_ids, dtype=torch.long),
                                          minlength=len(self.counts))[: len(self.counts)]

    def accept(self, seq, tokens: list[int]) -> None:
        if self.cfg.self_vocab and self.counts is not None:
            for t in tokens:
                self.counts[t] += 1

    def release(self, seq_id: int) -> None:
        pass

    def end_rollout(self) -> None:
        pass

    # ---- weights ----------------------------------------------------------------------------------------------

    def refresh(self, force: bool = False) -> bool:
        """Re-quantizes the policy's weights where they may have moved since (a new batch); True if it did."""
        key = packed._GENERATION[0]
        if not force and self.key == key and self.head_dense is not None:
            return False
        t = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: packed_linear keys on their versions
            self._quantize()
        self.key = key
        self.quantize_s = time.perf_counter() - t
        self.quantizations += 1
        return True

    def _quantize(self) -> None:
        m, kind = self.model, self.cfg.self_quant
        self.q, self.rows = {}, {}
        for layer in m.model.layers:
            a, f = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj):
                self.q[lin] = quantize_linear(lin.weight, lin.bias, kind)
                self.rows[lin] = quant_rows(*lin.weight.shape, kind) if self.max_rows is None else self.max_rows
        w = m.lm_head.weight.detach()
        self.vocab = self._choose_vocab()
        rows = w if self.vocab is None else w[self.vocab]
        self.head = quantize_linear(rows, None, kind) if self.vocab is None else None
        self.head_rows = quant_rows(*rows.shape, kind) if self.max_rows is None else self.max_rows
        if self.vocab is None:
            self.head_dense = m.lm_head
        else:
            self.head_dense = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=w.device, dtype=w.dtype)
            self.head_dense.weight.requires_grad_(False).copy_(rows)

    def _choose_vocab(self) -> torch.Tensor | None:
        """The `self_vocab` most frequent tokens seen so far (ties: the lower id, BPE's earlier merge), with the
        stop tokens; None for the full vocabulary."""
        V, n = self.model.config.vocab_size, self.cfg.self_vocab
        if not n or n >= V:
            return None
        order = torch.argsort(-self.counts, stable=True)
        keep = set(order[:n].tolist()) | {t for t in self.model.config.eos_token_id if 0 <= t < V}
        return torch.tensor(sorted(keep), dtype=torch.long, device=self.model.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized copy (and of the draft vocabulary's dense head rows, where cut)."""
        n = sum(q.nbytes for q in self.q.values()) + (self.head.nbytes if self.head is not None else 0)
        if self.vocab is not None and self.head_dense is not None:
            n += self.head_dense.weight.numel() * self.head_dense.weight.element_size()
        return n

    def gauges(self) -> dict[str, float]:
        """Its memory beside the engine's (the quantized copy; its K/V is the target cache's own) and what its last
        re-quantization took, for a rollout's metrics."""
        return {"spec/self/quantized_mib": self.nbytes / 2**20, "spec/self/quantize_s": self.quantize_s}

    # ---- drafting ---------------------------------------------------------------------------------------------

    def _proj(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The quantized product up to its shape's rows (model/quant.py quant_rows: the int8 and int4 kernels reuse
        no weight across rows), the target's own above: a draft's weights need not be quantized to be lossless."""
        q = self.q.get(layer)
        return q(x) if q is not None and x.shape[0] <= self.rows[layer] else packed_linear(layer, x)

    def logits(self, ids: list[int], cache_lens: list[int], slots: list[int]) -> torch.Tensor:
        """One quantized pass: token ids[b] at position cache_lens[b] of slot slots[b], reading the cache below it
        and writing its K/V there. Returns draft-vocabulary logits [B, Vd] (float32)."""
        m = self.model
        dev = m.device
        step = make_step(cache_lens, [1] * len(ids), slots, dev, causal=False)
        x = m.model.embed_tokens(torch.tensor(ids, device=dev))
        cos, sin = rope_cos_sin(m.inv_freq, step.positions, x.dtype)
        for layer in m.model.layers:
            x = layer(x, cos, sin, step, self.kv, proj=self._proj)
        x = m.model.norm(x)
        # a cut head (8,192 rows) runs bf16: 0.17 ms at 1 row against 0.26 in int8 (quant_rows prices full heads)
        cut = self.vocab is not None
        out = self.head(x) if not cut and x.shape[0] <= self.head_rows else packed_linear(self.head_dense, x)
        return out.float()

    @torch.inference_mode()
    def propose(self, seqs: list, budgets: list[int], depths: list[int]) -> list[DraftTree | None]:
        self.last_levels = 0
        out: list[DraftTree | None] = [None] * len(seqs)
        want = [min(b, d, self.kv.room(s.slot, s.cache_len) + 1) for s, b, d in zip(seqs, budgets, depths)]
        live = [i for i, w in enumerate(want) if w > 0]
        if not live:
            return out
        self.refresh()
        self.kv.tables.sync()
        tokens: dict[int, list[int]] = {i: [] for i in live}
        qs: dict[int, dict[int, torch.Tensor]] = {i: {} for i in live}
        level = 0
        while live:
            ids = [tokens[i][-1] if level else seqs[i].output_ids[-1] for i in live]
            logits = self.logits(ids, [seqs[i].cache_len + level for i in live], [seqs[i].slot for i in live])
            drawn = self._draw(logits, [seqs[i] for i in live], level)
            for r, i in enumerate(live):
                tokens[i].append(drawn[r][0])
                if drawn[r][1] is not None:
                    qs[i][level - 1] = drawn[r][1]
            level += 1
            live = [i for i in live if len(tokens[i]) < want[i]]
        self.last_levels = level
        for i, toks in tokens.items():
            out[i] = DraftTree(toks, list(range(-1, len(toks) - 1)), q=qs[i], drafter=self.name)
        return out

    def _draw(self, logits: torch.Tensor, seqs: list, level: int) -> list[tuple[int, torch.Tensor | None]]:
        """Per sequence, its draft token at this level and (coupled off, sampled) the distribution q it came from."""
        greedy = [s.params.greedy for s in seqs]
        ids = self.vocab
        if all(greedy):
            top = logits.argmax(-1)
            return [(int(t), None) for t in (top if ids is None else ids[top]).tolist()]
        temps = torch.tensor([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs],
                             device=logits.device)
        logq = torch.log_softmax(logits / temps[:, None], -1)
        if ids is not None:
            full = logq.new_full((len(seqs), self.model.config.vocab_size), float("-inf"))
            full[:, ids] = logq
            logq = full
        coupled = self.cfg.coupled
        seeds = [signed64(s.seed if coupled else s.seed ^ DRAFT_SALT) for s in seqs]
        pos = [len(s.output_ids) + level for s in seqs]
        drawn = gumbel_argmax(logq, row_keys(seeds, pos, logq.device))
        top = logq.argmax(-1)
        out = []
        for r, s in enumerate(seqs):
            if greedy[r]:
                out.append((int(top[r]), None))
            else:
                out.append((int(drawn[r]), None if coupled else logq[r].exp()))
        return out
