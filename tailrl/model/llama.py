"""One implementation of the Llama family (Llama, SmolLM2, Qwen2, Qwen3) with Hugging Face parameter names.

Three forwards share the weights: `forward` runs new tokens of many sequences against a KV cache (prefill,
decode, or a draft tree in one pass); `forward_full` is the plain causal pass over whole sequences;
`forward_shared` is the pass training differentiates through, in which responses to one prompt attend to one copy
of it (rl/actor/packing.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import paged_attention
from .chunked import chunked_attention, in_calls, pad_rows, tiled_linear
from .config import ModelConfig
from .packed import packed_linear
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from .step import StepMeta


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention over the cache: q [B, heads, Q, D], keys/vals [B, kv_heads, K, D], mask [B, 1, Q, K].
    The query heads that share a K/V head are stacked into one [group * Q] block of rows, so the CPU's fused kernel
    runs kv_heads tiles of group * Q rows per sequence instead of heads tiles of Q rows: 1.8x faster at batch 64 with
    4 query rows (benchmarks/RESULTS.md, session 9). The invariant passes stack the heads the same way
    (model/chunked.py)."""
    B, H, Q, D = q.shape
    group = H // keys.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(B, keys.shape[1], group * Q, D), keys, vals,
                                       attn_mask=mask.repeat(1, 1, group, 1))
    return o.reshape(B, H, Q, D)


@dataclass
class SharedPrompts:
    """The layout of `CausalLM.forward_shared`. Rows come packed, with no padding: the S prompts' tokens, then the M
    responses' input tokens. The attention lays them out on grids, prompts [S, P] and responses [M, R] (p_idx and
    r_idx: each packed row's place there); response m continues prompt seg_of[m], and mask [M, 1, R, P + R] says
    which of its prompt's keys (the real ones) and of its own (causally) each response row sees."""

    S: int
    P: int
    M: int
    R: int
    p_idx: torch.Tensor  # [prompt rows] index into S * P
    r_idx: torch.Tensor  # [response rows] index into M * R
    seg_of: torch.Tensor  # [M]
    mask: torch.Tensor  # [M, 1, R, P + R] bool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def _qkv(self, x, cos, sin, proj=None):
        proj = proj or (lambda layer, t: layer(t))
        shape = x.shape[:-1]
        q = proj(self.q_proj, x).view(*shape, self.n_heads, self.head_dim)
        k = proj(self.k_proj, x).view(*shape, self.n_kv, self.head_dim)
        v = proj(self.v_proj, x).view(*shape, self.n_kv, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_cached(self, x, cos, sin, step: StepMeta, kv, proj=None) -> torch.Tensor:
        """Writes the new tokens' K/V at their rows' (slot, position) in the paged cache `kv` (engine/kv_cache.py),
        then attends: a causal step (whole prompts from position 0) over the new tokens with the causal kernel, an
        invariant step by our kernel in place (model/paged_attention.py; off a CPU over each sequence's own key
        chunks, model/chunked.py), any other over each sequence's keys gathered up to the pass's longest, under
        step.mask (a decode or verify pass on a CPU: read in place by our kernel)."""
        # [T, heads, D] (an invariant pass: padded to whole row tiles, its products in the probe's calls; a plain
        # pass: weights packed once per weight version, model/packed.py)
        # (proj: another product, the self drafter's quantized one, speculative/self_draft.py)
        q, k, v = self._qkv(x, cos, sin, proj or (in_calls if step.row_tile else packed_linear))
        T = step.token_pos.shape[0]
        kv.write(self.layer_idx, step, k[:T], v[:T])  # written before it is read: a row sees its own key
        if step.row_tile:
            if step.chunks is not None:
                o = chunked_attention(q[:T], *kv.pools(self.layer_idx), step.chunks, kv.chunk_blocks(step))
            else:
                o = self._in_place(q[:T], kv, step)
            return in_calls(self.o_proj, pad_rows(o, x.shape[0]))
        if step.causal:
            o = self._attend(q, k, v, step)
        elif step.max_q <= paged_attention.MAX_Q and paged_attention.supports(q, kv.pools(self.layer_idx)[0]):
            # a decode or verify pass: keys read in place
            B, Q = step.num_seqs, step.max_q
            rows = self._pad(q[:T], step).transpose(1, 2)  # [B, Q, heads, D]: shorter drafts padded to Q rows
            o = paged_attention.paged_attention(rows, *kv.pools(self.layer_idx), kv.block_table(), step.slots,
                                                step.mask.view(B, Q, -1))
            o = o.view(B * Q, self.n_heads * self.head_dim)
            o = o if step.pad_idx is None else o[step.pad_idx]
        else:
            o = self._attend(q, *kv.keys(self.layer_idx, step), step)
        return (proj or packed_linear)(self.o_proj, o)

    def _in_place(self, q: torch.Tensor, kv, step: StepMeta) -> torch.Tensor:
        """An invariant pass's attention, by our kernel over each sequence's keys in the cache: causal rows, or a
        verify pass's tree mask. Returns [T, heads * D]."""
        pools = kv.pools(self.layer_idx)
        if not paged_attention.supports(q, pools[0]):
            raise RuntimeError(f"a batch-invariant pass on a CPU runs in fp32 or bf16 with head_dim a multiple of 8 "
                               f"up to 256, not {q.dtype} with head_dim {self.head_dim}")
        B, Q = step.num_seqs, step.max_q
        mask = None if step.mask is None else step.mask.view(B, Q, -1)
        o = paged_attention.paged_attention(self._pad(q, step).transpose(1, 2), *pools, kv.block_table(), step.slots,
                                            mask, step.lens)
        o = o.view(B * Q, self.n_heads * self.head_dim)
        return o if step.pad_idx is None else o[step.pad_idx]

    def _pad(self, t: torch.Tensor, step: StepMeta) -> torch.Tensor:
        """[T, heads, D] packed -> [B, heads, max_q, D] (right-padded with zeros per sequence)."""
        B, Q = step.num_seqs, step.max_q
        if step.pad_idx is not None:
            padded = t.new_zeros(B * Q, *t.shape[1:])
            padded[step.pad_idx] = t
            t = padded
        return t.view(B, Q, *t.shape[1:]).transpose(1, 2)

    def _attend(self, q, keys, vals, step: StepMeta) -> torch.Tensor:
        """keys/vals [B, n_kv, K, D] from the cache, or for a causal step the packed new tokens [T, n_kv, D] (padded
        here like the queries: right padding is harmless under a causal mask). Returns [T, heads * D]."""
        if step.causal:
            keys, vals = self._pad(keys, step), self._pad(vals, step)
            o = F.scaled_dot_product_attention(self._pad(q, step), keys, vals, is_causal=True,
                                               enable_gqa=self.n_kv != self.n_heads)
        else:
            o = self._masked(self._pad(q, step), keys, vals, step.mask)
        o = o.transpose(1, 2).reshape(step.num_seqs * step.max_q, self.n_heads * self.head_dim)
        return o if step.pad_idx is None else o[step.pad_idx]

    def _masked(self, q, keys, vals, mask) -> torch.Tensor:
        if self.n_kv != self.n_heads:  # each K/V head's query heads as one block of rows: the same bits, fewer and
            return _grouped_attention(q, keys, vals, mask)  # larger kernel tiles
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)

    def forward_shared(self, x, cos, sin, lay: SharedPrompts) -> torch.Tensor:
        """x [prompt rows + response rows, H], packed. A prompt attends causally to itself; a response to its
        prompt's keys (gathered, so the backward sums their gradients) and causally to its own."""
        S, P, M, R, n_p = lay.S, lay.P, lay.M, lay.R, lay.p_idx.shape[0]
        q, k, v = self._qkv(x, cos, sin)  # [N, heads, D]
        gqa = self.n_kv != self.n_heads

        def grids(t):
            p = t.new_zeros(S * P, *t.shape[1:]).index_put((lay.p_idx,), t[:n_p])
            r = t.new_zeros(M * R, *t.shape[1:]).index_put((lay.r_idx,), t[n_p:])
            return p.view(S, P, *t.shape[1:]).transpose(1, 2), r.view(M, R, *t.shape[1:]).transpose(1, 2)

        (qp, qr), (kp, kr), (vp, vr) = grids(q), grids(k), grids(v)
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)
        # index_select, not kp[seg_of]: the backward of advanced indexing is index_put_(accumulate=True), which on a
        # CPU with 2+ threads adds floats atomically in thread order where indices repeat (a prompt's samples all
        # gather its keys), so gradients differed run to run in the last bits; index_select's backward (index_add_)
        # sums in index order
        keys = torch.cat([kp.index_select(0, lay.seg_of), kr], dim=2)
        vals = torch.cat([vp.index_select(0, lay.seg_of), vr], dim=2)
        if gqa:
            orr = _grouped_attention(qr, keys, vals, lay.mask)
        else:
            orr = F.scaled_dot_product_attention(qr, keys, vals, attn_mask=lay.mask)
        o = torch.cat([op.transpose(1, 2).reshape(S * P, -1)[lay.p_idx], orr.transpose(1, 2).reshape(M * R, -1)[lay.r_idx]])
        return self.o_proj(o)

    def forward_full(self, x, cos, sin, attn_mask=None) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)  # [B, L, heads, D]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=attn_mask is None, enable_gqa=self.n_kv != self.n_heads,
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, proj=None):
        """proj(layer, x): how the products run (an invariant pass's in the probe's calls, model/chunked.py
        `in_calls`; a plain engine pass's packed, model/packed.py); None: the modules themselves."""
        proj = proj or (lambda layer, t: layer(t))
        return proj(self.down_proj, F.silu(proj(self.gate_proj, x)) * proj(self.up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, step=None, kv=None, attn_mask=None, shared=None, proj=None):
        """proj(linear, x): the cached pass's products (None: the pass's own, below)."""
        h = self.input_layernorm(x)
        if step is not None:
            x = x + self.self_attn.forward_cached(h, cos, sin, step, kv, proj)
        elif shared is not None:
            x = x + self.self_attn.forward_shared(h, cos, sin, shared)
        else:
            x = x + self.self_attn.forward_full(h, cos, sin, attn_mask)
        proj = None if step is None else proj or (in_calls if step.row_tile > 0 else packed_linear)
        return x + self.mlp(self.post_attention_layernorm(x), proj)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow Hugging Face (model.layers.N.self_attn.q_proj.weight, lm_head.weight, ...)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _run_layers(self, x, positions, hidden_layers, step=None, kv=None, attn_mask=None, shared=None):
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if step is None and shared is None:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        hidden = {}
        n = len(self.model.layers)
        if 0 in hidden_layers:
            hidden[0] = x
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, step, kv, attn_mask, shared)
            if i + 1 in hidden_layers and i + 1 < n:
                hidden[i + 1] = x
        x = self.model.norm(x)
        if n in hidden_layers:  # like HF output_hidden_states, the last entry is after the final norm
            hidden[n] = x
        return x, hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        step: StepMeta,
        kv,
        logits_idx: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ):
        """input_ids [T] packed new tokens of step.num_seqs sequences. Writes their K/V into kv and returns
        (logits for the tokens in logits_idx, or all, [N, V]; {layer: hidden [T, H]})."""
        T, tile = input_ids.shape[0], step.row_tile
        positions = step.positions
        if tile:  # an invariant pass: padding rows run through every product and write no K/V
            input_ids, positions = pad_rows(input_ids, tile), pad_rows(positions, tile)
        x = self.model.embed_tokens(input_ids)
        x, hidden = self._run_layers(x, positions, hidden_layers, step=step, kv=kv)
        x = x[logits_idx] if logits_idx is not None else x[:T]
        if not tile:
            return packed_linear(self.lm_head, x), hidden
        return tiled_linear(self.lm_head, x, tile), {i: h[:T] for i, h in hidden.items()}

    def forward_shared(self, input_ids: torch.Tensor, positions: torch.Tensor, lay: SharedPrompts) -> torch.Tensor:
        """input_ids, positions [prompt rows + response rows], packed as `lay` says (rl/actor/packing.py builds it).
        Returns the last hidden state after the final norm, one row per input token; differentiable."""
        x, _ = self._run_layers(self.model.embed_tokens(input_ids), positions, (), shared=lay)
        return x

    def forward_full(
        self,
        input_ids: torch.Tensor,
        hidden_layers: tuple[int, ...] = (),
        attn_mask: torch.Tensor | None = None,
        logits_start: int = 0,
    ):
        """Plain causal forward over [B, L] (right padding is harmless under a causal mask); differentiable.
        Returns (logits [B, L - logits_start, V], {layer: hidden [B, L, H]}); training skips prompt logits."""
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x, hidden = self._run_layers(x, positions, hidden_layers, attn_mask=attn_mask)
        return self.lm_head(x[:, logits_start:]), hidden
