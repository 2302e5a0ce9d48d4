"""The rollout engine: `Engine.generate(prompts, sampling) -> list[Completion]` with continuous batching."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..model.llama import CausalLM
from ..model.step import make_step
from ..spec.config import SpecConfig
from ..spec.drafters import make_drafters
from ..spec.selector import OFF, Arm, Selector, batch_bucket
from ..spec.tree import DraftTree
from ..spec.verify import verify_tree
from .kv_cache import KVCache
from .sampler import sample, warp_tensors, warped_logprobs
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    kv_cache_gb: float | None = None  # None: 25% of RAM (CPU, at most 8 GiB) or 60% of free GPU memory
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 4096
    seed: int = 0
    tail_batch: int = 4  # the long tail (for stats): at most max(tail_batch, tail_frac x requests) sequences running
    tail_frac: float = 0.3
    capture_hidden: bool = False  # keep the target's last hidden states per token (drafter training data)
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(mode="off"))

    def __post_init__(self):
        if isinstance(self.spec, dict):
            self.spec = SpecConfig(**self.spec)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} must be >= 1")


@dataclass
class GenerateStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    generated_tokens: int = 0
    peak_kv_bytes: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)  # decode batch size -> steps
    draft_s: float = 0.0  # proposing drafts
    forward_s: float = 0.0  # decode / verification forwards
    verify_s: float = 0.0  # acceptance, KV compaction, bookkeeping
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> seq_steps, proposals, drafted, accepted
    choices: dict[int, dict[str, int]] = field(default_factory=dict)  # batch-size bucket -> strategy -> steps
    by_bucket: dict[int, list[float]] = field(default_factory=dict)  # batch-size bucket -> [decode tokens, seconds]
    plain_est_s: float = 0.0  # what plain decoding would have taken for the same tokens (selector's cost model)
    tail_batch: int = 4  # decode tokens and seconds while at most this many sequences run (the long tail)
    tail_tokens: int = 0
    tail_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def tail_tokens_per_s(self) -> float:
        return self.tail_tokens / self.tail_s if self.tail_s else 0.0

    @property
    def speedup_est(self) -> float:
        return self.plain_est_s / self.decode_s if self.plain_est_s and self.decode_s else 1.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens emitted per sequence per decode step, over all steps (1 = plain decoding)."""
        seq_steps = sum(b * n for b, n in self.batch_sizes.items())
        decode_tokens = sum(cell[0] for cell in self.by_bucket.values())
        return decode_tokens / seq_steps if seq_steps else 0.0

    def accept_length(self, drafter: str) -> float:
        """Mean tokens emitted per sequence per step when the drafter was chosen (1 = no gain)."""
        d = self.drafters.get(drafter)
        return (d["seq_steps"] + d["accepted"]) / d["seq_steps"] if d and d["seq_steps"] else 0.0

    def summary(self) -> dict:
        out = {"tokens": self.generated_tokens, "seconds": round(self.total_s, 3), "tokens_per_s": round(self.tokens_per_s, 2),
               "tail_tokens_per_s": round(self.tail_tokens_per_s, 2), "draft_s": round(self.draft_s, 3),
               "forward_s": round(self.forward_s, 3), "verify_s": round(self.verify_s, 3),
               "accept_length": round(self.mean_accept_length, 3), "speedup_est": round(self.speedup_est, 3),
               "choices": self.choices}
        for name, d in self.drafters.items():
            out[f"accept_length/{name}"] = round(self.accept_length(name), 3)
            out[f"drafted/{name}"], out[f"accepted/{name}"] = d["drafted"], d["accepted"]
        return out


class Completions(list):
    """The completions of one generate call, with that call's engine statistics in `.stats`."""

    stats: GenerateStats


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.6 * free)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(0.25 * ram, 8 * 2**30))


class Engine:
    def __init__(self, model: CausalLM, tokenizer=None, config: EngineConfig | None = None, learned=None):
        """learned: a learned drafter (tailrl.drafter.propose.LearnedDrafter) offered to the selector next to
        the model-free ones when spec.mode is auto or learned."""
        self.model, self.tokenizer = model, tokenizer
        self.config = config or EngineConfig()
        self.device = model.device
        mc = model.config
        self.max_model_len = min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        budget = int(self.config.kv_cache_gb * 2**30) if self.config.kv_cache_gb else default_kv_budget(self.device)
        self.kv = KVCache(mc, budget, self.device, model.dtype)
        self.eos_ids = set(mc.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.rng = torch.Generator().manual_seed(self.config.seed)
        self.last_stats = GenerateStats()
        spec = self.config.spec
        self.drafters = make_drafters(spec)  # their history outlives generate calls: one call = one RL step
        if spec.mode == "learned" and learned is None:
            raise ValueError("spec mode 'learned' needs a learned drafter (drafter.enabled or drafter.path)")
        self.learned = learned if spec.mode in ("auto", "learned") else None
        if self.learned is not None:
            self.learned.attach(self.kv)
            self.drafters["learned"] = self.learned
            if "history" in self.drafters:
                from ..drafter.propose import MergedDrafter

                merged = MergedDrafter(self.drafters["history"], self.learned)
                self.drafters[merged.name] = merged
        self.capture = self.config.capture_hidden or self.learned is not None
        self.hidden_layer = (mc.num_hidden_layers,)
        self.on_step = None  # callback(running sequences, sequences finished this step) after every engine step
        self.selector = Selector(spec, list(self.drafters)) if spec.mode != "off" else None
        self._shadow_cursor = 0

    # ---- requests -------------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """str -> tokens as is; list of chat messages -> the tokenizer's chat template; list[int] -> as given."""
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            self._need_tokenizer("a chat prompt")
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be text, chat messages or token ids, got {type(prompt).__name__}")

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer and this model has none; pass token ids")

    def _make_group(self, index: int, prompt, params: SamplingParams, t_submit: float) -> list[Sequence]:
        empty_chat = isinstance(prompt, list) and prompt and all(isinstance(m, dict) and not m.get("content") for m in prompt)
        ids = [] if empty_chat else self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        V = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {V}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, longer than the context: max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        if not self.kv.fits(1, len(ids) + max_tokens):
            raise ValueError(
                f"the prompt needs {len(ids) + max_tokens} tokens of KV cache per sample but the budget holds "
                f"{self.kv.budget_tokens}; raise kv_cache_gb or lower max_tokens"
            )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        group = []
        for j in range(params.n):
            seed = params.seed + j if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.rng))
            group.append(Sequence(index, j, ids, params, seed, max_tokens, stop_ids, t_submit))
        return group

    # ---- the loop -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> Completions:
        """Returns one Completion per sample, ordered by (prompt, sample). A bad prompt fails alone
        (finish_reason "error" naming the problem); the others finish."""
        sampling = sampling or SamplingParams()
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        sched = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_prefill_tokens)
        stats = self.last_stats = GenerateStats()
        t0 = time.perf_counter()
        all_seqs: list[Sequence] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                group = self._make_group(i, prompt, p, t0)
                # samples of a prompt share a prefill in chunks that fit the batch and the KV budget at once
                chunk = min(self.config.max_num_seqs, max(self.kv.budget_tokens // group[0].reserved_len, 1))
                for k in range(0, len(group), chunk):
                    sched.add(group[k : k + chunk])
            except ValueError as e:
                log.warning("request %d rejected: %s", i, e)
                group = [Sequence(i, j, [], p, 0, 0, frozenset(), t0) for j in range(p.n)]
                for s in group:
                    s.finish("error", str(e))
            all_seqs.extend(group)
        stats.tail_batch = max(self.config.tail_batch, int(self.config.tail_frac * len(all_seqs)))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(all_seqs), desc="generate", unit="seq", dynamic_ncols=True)
            bar.update(sum(s.finished for s in all_seqs))
        while sched.has_work():
            groups = sched.admit()
            if groups:
                self._prefill(groups, sched.running, stats)
            elif sched.running:
                self._decode(sched.running, stats)
            else:  # nothing fits and nothing runs: cannot happen after _make_group's budget check
                raise RuntimeError("scheduler stalled: a waiting request does not fit the empty KV cache")
            done = sched.release_finished()
            if self.on_step is not None:
                self.on_step(sched.running, done)
            stats.steps += 1
            stats.peak_kv_bytes = max(stats.peak_kv_bytes, self.kv.allocated_bytes())
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(tok_s=f"{stats.generated_tokens / (time.perf_counter() - t0):.1f}", running=len(sched.running))
        if bar is not None:
            bar.close()
        for d in self.drafters.values():
            d.end_step()
        stats.total_s = time.perf_counter() - t0
        result = Completions(s.to_completion() for s in all_seqs)
        result.stats = stats
        return result

    def _prefill(self, groups: list[list[Sequence]], running: list[Sequence], stats: GenerateStats) -> None:
        t = time.perf_counter()
        leaders = [g[0] for g in groups]
        lens = [len(s.prompt_ids) for s in leaders]
        self.kv.ensure(len(running), max(lens) + 1)
        step = make_step([0] * len(leaders), lens, [s.slot for s in leaders], self.device)
        ids = torch.tensor([t for s in leaders for t in s.prompt_ids], device=self.device)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        t_fwd = time.perf_counter()
        logits, hidden = self.model(ids, step, self.kv, logits_idx=last, hidden_layers=self.hidden_layer if self.capture else ())
        if self.selector is not None:
            self.selector.record_forward(len(ids), time.perf_counter() - t_fwd)
        chunks = hidden[self.hidden_layer[0]].split(lens) if self.capture else [None] * len(groups)
        for g, plen, chunk in zip(groups, lens, chunks):
            for s in g[1:]:  # the n samples of a prompt share its prefill
                self.kv.copy(g[0].slot, s.slot, plen)
            for s in g:
                s.t_admit = t
                if chunk is not None:
                    s.hidden = [chunk]
        rows = torch.repeat_interleave(logits, torch.tensor([len(g) for g in groups], device=self.device), dim=0)
        seqs = [s for g in groups for s in g]
        self._sample_and_append(seqs, rows)
        for s in seqs:
            s.spec_depth = self.config.spec.init_depth
            for d in self.drafters.values():
                d.start(s)
        stats.prefill_steps += 1
        stats.prefill_s += time.perf_counter() - t

    def _decode(self, running: list[Sequence], stats: GenerateStats) -> None:
        """One decode step for every running sequence; with speculation, each verifies its draft tree in the
        same forward and emits 1 + accepted tokens."""
        t0 = time.perf_counter()
        B = len(running)
        arm = self.selector.choose(B) if self.selector else OFF
        trees = self._propose(running, arm) if arm != OFF else [None] * B
        t1 = time.perf_counter()
        cache_lens = [s.cache_len for s in running]
        q_lens = [1 + len(t) if t else 1 for t in trees]
        self.kv.ensure(B, max(c + q for c, q in zip(cache_lens, q_lens)))
        ids, positions = [], []
        for s, t, c in zip(running, trees, cache_lens):
            ids.append(s.output_ids[-1])
            positions.append(c)
            if t:
                ids.extend(t.tokens)
                positions.extend(c + d for d in t.depths())
        any_tree = any(trees)
        step = make_step(cache_lens, q_lens, list(range(B)), self.device,
                         positions=torch.tensor(positions) if any_tree else None,
                         tree_masks=[t.attention_mask() if t else None for t in trees] if any_tree else None)
        logits, hidden = self.model(torch.tensor(ids, device=self.device), step, self.kv,
                                    hidden_layers=self.hidden_layer if self.capture else ())
        t2 = time.perf_counter()
        h = hidden[self.hidden_layer[0]] if self.capture else None
        if not any_tree:
            if h is not None:
                for b, s in enumerate(running):
                    s.hidden.append(h[b : b + 1])
            emitted = self._sample_and_append(running, logits)
        else:
            emitted = self._verify(running, trees, logits, cache_lens, q_lens, h)
        t3 = time.perf_counter()
        drafted = sum(len(t) for t in trees if t)
        if self.selector is not None:
            plain = self.selector.cost.predict(B)
            stats.plain_est_s += (emitted / B) * plain if plain else t3 - t0
            self.selector.record(arm, B, len(ids), t2 - t1, t3 - t0, emitted, drafted, t1 - t0)
            self._shadow_drafts(running, arm)
        stats.decode_steps += 1
        stats.decode_s += t3 - t0
        stats.draft_s += t1 - t0
        stats.forward_s += t2 - t1
        stats.verify_s += t3 - t2
        stats.batch_sizes[B] = stats.batch_sizes.get(B, 0) + 1
        cell = stats.by_bucket.setdefault(batch_bucket(B), [0, 0.0])
        cell[0] += emitted
        cell[1] += t3 - t0
        if B <= stats.tail_batch:
            stats.tail_tokens += emitted
            stats.tail_s += t3 - t0
        if self.selector is not None:
            counts = stats.choices.setdefault(batch_bucket(B), {})
            counts[str(arm)] = counts.get(str(arm), 0) + 1
        if arm != OFF:
            d = stats.drafters.setdefault(arm.drafter, {"seq_steps": 0, "proposals": 0, "drafted": 0, "accepted": 0})
            d["seq_steps"] += B
            d["proposals"] += sum(1 for t in trees if t)
            d["drafted"] += drafted
            d["accepted"] += emitted - B

    def _propose(self, running: list[Sequence], arm: Arm) -> list[DraftTree | None]:
        drafter = self.drafters[arm.drafter]
        V = self.model.config.vocab_size
        rooms = [s.max_tokens - len(s.output_ids) - 1 for s in running]  # never draft past max_tokens (or the KV)
        budgets = [max(min(arm.budget, r), 0) for r in rooms]
        depths = [max(min(s.spec_depth, r), 0) for s, r in zip(running, rooms)]
        if hasattr(drafter, "propose_batch"):
            try:
                trees = drafter.propose_batch(running, budgets, depths)
            except Exception as e:  # a failing drafter costs this step its drafts, nothing else
                log.warning("drafter %s failed on a batch of %d: %s", arm.drafter, len(running), e)
                trees = [None] * len(running)
        else:
            trees = []
            for s, budget, depth in zip(running, budgets, depths):
                tree = None
                if budget > 0 and depth > 0:
                    try:
                        tree = drafter.propose(s, budget, depth)
                    except Exception as e:  # a drafter failing on one sequence costs it its draft, nothing else
                        log.warning("drafter %s failed on request %d: %s", arm.drafter, s.prompt_index, e)
                trees.append(tree)
        for i, (s, tree) in enumerate(zip(running, trees)):
            if tree is not None:
                try:
                    if len(tree) > budgets[i]:
                        raise ValueError(f"{len(tree)} nodes over the budget of {budgets[i]}")
                    tree.validate(V)
                except Exception as e:
                    log.warning("drafter %s gave request %d a bad tree: %s", arm.drafter, s.prompt_index, e)
                    trees[i] = None
        return [t if t else None for t in trees]

    def _shadow_drafts(self, running: list[Sequence], arm: Arm, per_step: int = 8) -> None:
        """Measures the acceptance of drafters not chosen this step: a few sequences per step keep a pending
        draft path per drafter that is scored against the tokens they emit next."""
        others = [name for name in self.drafters if name != arm.drafter]
        if not others:
            return
        max_budget = max(self.config.spec.budgets)
        start = self._shadow_cursor % len(running)
        self._shadow_cursor += per_step
        tick = self._shadow_cursor // per_step
        for i, s in enumerate((running[start:] + running[:start])[:per_step]):
            if s.finished:
                continue
            for name in others:
                d = self.drafters[name]  # drafters whose proposals cost forwards shadow on fewer sequences and steps
                if i >= getattr(d, "shadow_seqs", per_step) or tick % getattr(d, "shadow_every", 1):
                    continue
                pending = s.spec.get(("shadow", name))
                if pending is not None:
                    at, path = pending
                    got = s.output_ids[at:]
                    m = 0
                    while m < min(len(path), len(got)) and path[m] == got[m]:
                        m += 1
                    if m < min(len(path), len(got)) or len(got) >= len(path):
                        self.selector.record_shadow(name, m, len(path))
                        pending = None
                if pending is None:
                    try:
                        depth = self.config.spec.init_depth if hasattr(d, "propose_batch") else self.config.spec.max_depth
                        tree = d.propose(s, max_budget, depth)
                    except Exception:
                        tree = None
                    path = tree.top_path() if tree else []
                    if path:
                        s.spec[("shadow", name)] = (len(s.output_ids), path)
                    else:
                        s.spec.pop(("shadow", name), None)
                        self.selector.record_shadow(name, 0, 0)

    def _verify(self, running, trees, logits, cache_lens, q_lens, hidden=None) -> int:
        params = [s.params for s, q in zip(running, q_lens) for _ in range(q)]
        logp = warped_logprobs(logits, *warp_tensors(params, self.device))
        emitted, offset = 0, 0
        spec = self.config.spec
        for s, tree, c, q in zip(running, trees, cache_lens, q_lens):
            rows = logp[offset : offset + q]
            offset += q
            s.decode_steps += 1
            if tree is None:
                verdict_tokens, verdict_lps, accepted = *self._draw_one(s, rows[0]), []
            else:
                v = verify_tree(tree, rows, s.params.greedy, s.seed, len(s.output_ids))
                verdict_tokens, verdict_lps, accepted = v.tokens, v.logprobs, v.accepted_nodes
                src = [c + 1 + n for n in accepted]
                dst = list(range(c + 1, c + 1 + len(accepted)))
                if src != dst:  # keep only the accepted path, in order, right after the cache
                    self.kv.move(s.slot, src, dst)
                full = bool(accepted) and not tree.children(accepted[-1])
                s.spec_depth = min(2 * s.spec_depth, spec.max_depth) if full else max(s.spec_depth // 2, spec.min_depth)
            if hidden is not None:  # the verified path's hidden states: the root, then the accepted nodes
                rows = [offset - q] + [offset - q + 1 + a for a in accepted]
                s.hidden.append(hidden[torch.tensor(rows, device=hidden.device)])
            n = self._append(s, verdict_tokens, verdict_lps)
            emitted += n
            if tree is not None:
                used = min(len(accepted), n - 1)  # accepted tokens after a stop token are never emitted
                s.drafted += len(tree)
                s.accepted += used
                per = s.per_drafter.setdefault(tree.drafter or "?", [0, 0])
                per[0] += len(tree)
                per[1] += used
        return emitted

    def _draw_one(self, s: Sequence, row: torch.Tensor) -> tuple[list[int], list[float]]:
        tokens, lps = sample(row[None], [s.params.greedy], [s.seed], [len(s.output_ids)])
        return tokens, lps

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> int:
        params = [s.params for s in seqs]
        logprobs = warped_logprobs(logits, *warp_tensors(params, self.device))
        tokens, lps = sample(logprobs, [p.greedy for p in params], [s.seed for s in seqs], [len(s.output_ids) for s in seqs])
        emitted = 0
        for s, tok, lp in zip(seqs, tokens, lps):
            if s.output_ids:
                s.decode_steps += 1
            emitted += self._append(s, [tok], [lp])
        return emitted

    def _append(self, s: Sequence, tokens: list[int], lps: list[float]) -> int:
        """Appends emitted tokens up to the first that finishes the sequence; tells the drafters."""
        now = time.perf_counter()
        n = 0
        first = not s.output_ids
        for tok, lp in zip(tokens, lps):
            if not s.output_ids:
                s.t_first = now
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            n += 1
            try:
                self._check_finish(s, tok)
            except Exception as e:  # one request's failure (say, detokenizing) must not stop the batch
                log.warning("request %d sample %d failed: %s", s.prompt_index, s.sample_index, e)
                s.finish("error", f"{type(e).__name__}: {e}")
            if s.finished:
                break
        self.last_stats.generated_tokens += n
        if not first:
            s.decode_tokens += n
            for d in self.drafters.values():
                d.accept(s, s.output_ids[-n:])
        return n

    def _check_finish(self, s: Sequence, tok: int) -> None:
        if tok in s.stop_ids:
            s.finish("stop")
        elif s.params.stop and self._hit_stop_string(s):
            s.finish("stop")
        elif len(s.output_ids) >= s.max_tokens:
            s.finish("length")
        if s.finished and self.tokenizer is not None and not s.text:
            s.text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            for stop in s.params.stop:
                cut = s.text.find(stop)
                if cut >= 0:
                    s.text = s.text[:cut]

    def _hit_stop_string(self, s: Sequence) -> bool:
        window = max(len(x) for x in s.params.stop) + 4  # a stop string spans at most this many tokens
        tail = self.tokenizer.decode(s.output_ids[-window:], skip_special_tokens=True)
        return any(x in tail for x in s.params.stop)
