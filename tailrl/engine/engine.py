"""The rollout engine: `Engine.generate(prompts, sampling) -> list[Completion]` with continuous batching."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..model.llama import CausalLM
from ..model.step import make_step
from .kv_cache import KVCache
from .sampler import sample, warp_tensors, warped_logprobs
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Completion, Sequence

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    kv_cache_gb: float | None = None  # None: 25% of RAM (CPU, at most 8 GiB) or 60% of free GPU memory
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_prefill_tokens: int = 4096
    seed: int = 0

    def __post_init__(self):
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

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0


def default_kv_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.6 * free)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(0.25 * ram, 8 * 2**30))


class Engine:
    def __init__(self, model: CausalLM, tokenizer=None, config: EngineConfig | None = None):
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
        if not self.kv.fits(params.n, len(ids) + max_tokens):
            raise ValueError(
                f"the prompt needs {params.n} x {len(ids) + max_tokens} tokens of KV cache but the budget holds "
                f"{self.kv.budget_tokens}; raise kv_cache_gb or lower n / max_tokens"
            )
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        group = []
        for j in range(params.n):
            seed = params.seed + j if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.rng))
            group.append(Sequence(index, j, ids, params, torch.Generator().manual_seed(seed), max_tokens, stop_ids, t_submit))
        return group

    # ---- the loop -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompts: list, sampling: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[Completion]:
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
                sched.add(group)
            except ValueError as e:
                log.warning("request %d rejected: %s", i, e)
                group = [Sequence(i, j, [], p, self.rng, 0, frozenset(), t0) for j in range(p.n)]
                for s in group:
                    s.finish("error", str(e))
            all_seqs.extend(group)
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
            stats.steps += 1
            stats.peak_kv_bytes = max(stats.peak_kv_bytes, self.kv.allocated_bytes())
            if bar is not None and done:
                bar.update(len(done))
                bar.set_postfix(tok_s=f"{stats.generated_tokens / (time.perf_counter() - t0):.1f}", running=len(sched.running))
        if bar is not None:
            bar.close()
        stats.total_s = time.perf_counter() - t0
        return [s.to_completion() for s in all_seqs]

    def _prefill(self, groups: list[list[Sequence]], running: list[Sequence], stats: GenerateStats) -> None:
        t = time.perf_counter()
        leaders = [g[0] for g in groups]
        lens = [len(s.prompt_ids) for s in leaders]
        self.kv.ensure(len(running), max(lens) + 1)
        step = make_step([0] * len(leaders), lens, [s.slot for s in leaders], self.device)
        ids = torch.tensor([t for s in leaders for t in s.prompt_ids], device=self.device)
        last = torch.tensor(lens, device=self.device).cumsum(0) - 1
        logits, _ = self.model(ids, step, self.kv, logits_idx=last)
        for g, plen in zip(groups, lens):
            for s in g[1:]:  # the n samples of a prompt share its prefill
                self.kv.copy(g[0].slot, s.slot, plen)
            for s in g:
                s.t_admit = t
        rows = torch.repeat_interleave(logits, torch.tensor([len(g) for g in groups], device=self.device), dim=0)
        self._sample_and_append([s for g in groups for s in g], rows)
        stats.prefill_steps += 1
        stats.prefill_s += time.perf_counter() - t

    def _decode(self, running: list[Sequence], stats: GenerateStats) -> None:
        t = time.perf_counter()
        B = len(running)
        cache_lens = [s.cache_len for s in running]
        self.kv.ensure(B, max(cache_lens) + 1)
        step = make_step(cache_lens, [1] * B, list(range(B)), self.device)
        ids = torch.tensor([s.output_ids[-1] for s in running], device=self.device)
        logits, _ = self.model(ids, step, self.kv)
        self._sample_and_append(running, logits)
        stats.decode_steps += 1
        stats.decode_s += time.perf_counter() - t
        stats.batch_sizes[B] = stats.batch_sizes.get(B, 0) + 1

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        params = [s.params for s in seqs]
        logprobs = warped_logprobs(logits, *warp_tensors(params, self.device))
        tokens, lps = sample(logprobs, [p.greedy for p in params], [s.generator for s in seqs])
        now = time.perf_counter()
        for s, tok, lp in zip(seqs, tokens, lps):
            if not s.output_ids:
                s.t_first = now
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            self.last_stats.generated_tokens += 1
            try:
                self._check_finish(s, tok)
            except Exception as e:  # one request's failure (say, detokenizing) must not stop the batch
                log.warning("request %d sample %d failed: %s", s.prompt_index, s.sample_index, e)
                s.finish("error", f"{type(e).__name__}: {e}")

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
