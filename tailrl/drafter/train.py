"""Training the draft head: the loss on buffered hidden states, a trainer that owns a private copy of the
head (the engine's copy changes only when `publish` is called between rollouts), and the spot trainer that
runs it in the background while the rollout is in its long tail."""

from __future__ import annotations

import logging
import random
import threading
import time

import torch
import torch.nn.functional as F

from ..engine.tail import in_tail
from .buffer import DraftBuffer, DraftSample
from .config import DrafterConfig
from .eagle import EagleDrafter, choose_vocab

log = logging.getLogger(__name__)


def clone_head(head: EagleDrafter) -> EagleDrafter:
    copy = EagleDrafter(head.config, head.vocab.clone()).to(device=head.fc.weight.device, dtype=head.fc.weight.dtype)
    copy.load_trained(head.trained_state())
    if head._target:
        copy.bind(head.target)
    return copy


def make_batch(samples: list[DraftSample], max_window: int, device, dtype) -> dict:
    """Right-padded [B, L] inputs (h_i, x_{i+1}) for i in a window ending at L-3, the next position's hidden
    state as target, and a mask over the response positions."""
    rows = []
    for s in samples:
        L = len(s.tokens)
        end = L - 2  # last input position with a target (needs hidden[i + 1], i + 1 <= L - 2)
        start = max(0, end - max_window)
        rows.append((s, start, end))
    T = max(end - start for _, start, end in rows)
    B, H = len(rows), samples[0].hidden.shape[-1]
    h_in = torch.zeros(B, T, H)
    h_tgt = torch.zeros(B, T, H)
    ids = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    for b, (s, start, end) in enumerate(rows):
        n = end - start
        h = s.hidden.float()
        h_in[b, :n] = h[start:end]
        h_tgt[b, :n] = h[start + 1 : end + 1]
        ids[b, :n] = torch.tensor(s.tokens[start + 1 : end + 1])
        pos[b, :n] = torch.arange(start, end)
        pos[b, n:] = torch.arange(end, end + T - n)
        first = max(s.prompt_len - 1 - start, 0)  # the first drafted token follows the first response token
        mask[b, first:n] = 1.0
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) if k != "mask" else v.to(device)
            for k, v in {"h_in": h_in, "h_tgt": h_tgt, "ids": ids, "pos": pos, "mask": mask}.items()}


def draft_loss(head: EagleDrafter, batch: dict, cfg: DrafterConfig) -> tuple[torch.Tensor, dict]:
    """SmoothL1 between the predicted and the target's next hidden state, plus a soft cross-entropy of the
    draft head against the target's own distribution (over the draft vocabulary); top-1 agreement as accuracy."""
    g = head(batch["h_in"], batch["ids"], positions=batch["pos"])
    m = batch["mask"]
    denom = m.sum().clamp_min(1)
    l_h = (F.smooth_l1_loss(g.float(), batch["h_tgt"].float(), reduction="none").mean(-1) * m).sum() / denom
    W = head.head()
    with torch.no_grad():
        tgt_logits = (batch["h_tgt"] @ W.t()).float()
        p = torch.softmax(tgt_logits, -1)
    logq = torch.log_softmax((g @ W.t()).float(), -1)
    l_ce = (-(p * logq).sum(-1) * m).sum() / denom
    loss = cfg.hidden_weight * l_h + cfg.ce_weight * l_ce
    with torch.no_grad():
        acc = ((logq.argmax(-1) == tgt_logits.argmax(-1)).float() * m).sum() / denom
        # chance that one draft token sampled from q is accepted against p at temperature 1 (within the draft vocab)
        accept = ((torch.minimum(p, logq.exp()).sum(-1)) * m).sum() / denom
    return loss, {"drafter/loss": float(loss.detach()), "drafter/hidden_loss": float(l_h.detach()),
                  "drafter/ce_loss": float(l_ce.detach()), "drafter/top1_acc": float(acc),
                  "drafter/accept_prob": float(accept), "tokens": int(m.sum())}


class DrafterTrainer:
    """Trains a private copy of the head; `publish` copies its weights into the engine's head."""

    def __init__(self, head: EagleDrafter, cfg: DrafterConfig, buffer: DraftBuffer | None = None, seed: int = 0):
        self.cfg = cfg
        self.model = clone_head(head)
        self.buffer = buffer if buffer is not None else DraftBuffer(cfg.buffer_tokens, cfg.buffer_steps)
        self.opt = torch.optim.AdamW(self.model.trainable(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
        self.rng = random.Random(seed)
        self.steps = 0
        self.last: dict = {}
        self.lock = threading.Lock()

    def train_step(self, samples: list[DraftSample], micro_tokens: int = 0, stop=None) -> dict | None:
        """One optimizer step over samples, accumulated over micro-batches of about micro_tokens positions
        (0: one batch). `stop()` is checked between micro-batches: when it says so the step is dropped and
        None returned, so a caller that needs the cores back waits for one micro-batch at most."""
        groups, cur, n = [], [], 0
        for s in samples:
            cur.append(s)
            n += s.train_positions
            if micro_tokens and n >= micro_tokens:
                groups.append(cur)
                cur, n = [], 0
        if cur:
            groups.append(cur)
        total = max(sum(s.train_positions for s in samples), 1)
        with self.lock:
            self.model.train()
            p = self.model.fc.weight
            self.opt.zero_grad(set_to_none=True)
            sums: dict = {}
            for group in groups:
                if stop is not None and stop():
                    self.opt.zero_grad(set_to_none=True)
                    return None
                batch = make_batch(group, self.cfg.max_window, p.device, p.dtype)
                loss, info = draft_loss(self.model, batch, self.cfg)
                w = info["tokens"] / total
                (loss * w).backward()
                for k, v in info.items():
                    sums[k] = sums.get(k, 0.0) + (v if k == "tokens" else v * w)
            torch.nn.utils.clip_grad_norm_(self.model.trainable(), self.cfg.grad_clip)
            self.opt.step()
            self.sched.step()
            self.steps += 1
            self.last = sums
            return sums

    @torch.no_grad()
    def evaluate(self, samples: list[DraftSample], chunk: int = 16) -> dict:
        totals, n = {}, 0
        p = self.model.fc.weight
        for i in range(0, len(samples), chunk):
            batch = make_batch(samples[i : i + chunk], self.cfg.max_window, p.device, p.dtype)
            _, info = draft_loss(self.model, batch, self.cfg)
            for k, v in info.items():
                if k != "tokens":
                    totals[k] = totals.get(k, 0.0) + v * info["tokens"]
            n += info["tokens"]
        return {k: v / max(n, 1) for k, v in totals.items()}

    def train_from_buffer(self, steps: int, rl_step: int | None = None) -> dict:
        info = {}
        for _ in range(steps):
            samples = self.buffer.sample(self.cfg.batch_tokens, self.rng, rl_step)
            if samples:
                info = self.train_step(samples)
        return info

    def maybe_set_vocab(self, engine_head: EagleDrafter | None, eos_ids=()) -> bool:
        """Cuts the head to the draft vocabulary once the buffer has seen enough tokens (heads only differ in
        which target LM-head rows they read, so training so far is kept)."""
        if self.cfg.draft_vocab <= 0 or len(self.model.vocab) or self.buffer.tokens < 1000:
            return False
        vocab = choose_vocab(self.buffer.token_counts(self.model.config.vocab_size), self.cfg.draft_vocab, list(eos_ids))
        if not len(vocab):
            return False
        with self.lock:
            self.model.set_vocab(vocab)
        if engine_head is not None:
            engine_head.set_vocab(vocab)
        return True

    @torch.no_grad()
    def publish(self, engine_head: EagleDrafter) -> None:
        """Between rollouts only: the engine never sees weights change inside a generate call."""
        with self.lock:
            engine_head.load_trained(self.model.trained_state())
            if not torch.equal(engine_head.vocab.cpu(), self.model.vocab.cpu()):
                engine_head.set_vocab(self.model.vocab.clone())
            engine_head.sync_head()

    def state_dict(self) -> dict:
        return {**self.model.trained_state(), "vocab": self.model.vocab.cpu(),
                "optimizer": self.opt.state_dict(), "sched": self.sched.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.model.load_trained(state)
            self.model.set_vocab(state["vocab"])
            self.opt.load_state_dict(state["optimizer"])
            self.sched.load_state_dict(state["sched"])
            self.steps = state["steps"]


class SpotTrainer:
    """Background drafter training for the rollout's long tail. `resume()` lets it run, `pause()` stops it
    after at most the micro-batch in progress (and waits for that; a partly accumulated step is dropped), and
    it stops by itself before it would exceed `cfg.spot_share` of the previous RL step's time. It trains on
    its own threads (cfg.spot_threads). `clock` (seconds, perf_counter by default) times its steps against the
    share: a test gives a clock that steps advance, so the share is checked in steps, not in this machine's speed."""

    def __init__(self, trainer: DrafterTrainer, cfg: DrafterConfig, clock=time.perf_counter):
        self.trainer, self.cfg, self.clock = trainer, cfg, clock
        self._go = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._quit = False
        self._thread: threading.Thread | None = None
        self.rl_step = 0
        self.allowed_s = 0.0
        self.used_s = 0.0
        self.steps_this_rl_step = 0
        self.last_step_s = 0.0
        self.error: str | None = None

    def begin_step(self, rl_step: int, last_step_s: float) -> None:
        """A new RL step's share: spot_share of the last step's seconds, plus what earlier steps left unspent (at
        most spot_bank - 1 shares), less what the last one overspent (its first drafter step, whose time was not
        known yet): over a run, spot training takes its share on average, whatever one drafter step costs."""
        self.rl_step = rl_step
        share = self.cfg.spot_share * last_step_s
        left = self.allowed_s - self.used_s
        self.allowed_s = share + max(min(left, (self.cfg.spot_bank - 1) * share), -share)
        self.used_s = 0.0
        self.steps_this_rl_step = 0

    @property
    def running(self) -> bool:
        return self._go.is_set()

    def resume(self) -> bool:
        if self.used_s + self.last_step_s > self.allowed_s or not self.trainer.buffer.items or self.error:
            return False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tailrl-spot-trainer", daemon=True)
            self._thread.start()
        self._go.set()
        return True

    def pause(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Returns once no optimizer step is in progress (False if `timeout` passed first)."""
        self._go.clear()
        return self._idle.wait(timeout) if wait else True

    def close(self) -> None:
        self._quit = True
        self._go.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._go.clear()

    def _loop(self) -> None:
        torch.set_num_threads(self.cfg.spot_threads)
        while True:
            self._go.wait()
            if self._quit:
                return
            self._idle.clear()
            try:
                if not self._go.is_set():
                    continue
                t = self.clock()
                samples = self.trainer.buffer.sample(self.cfg.batch_tokens, self.trainer.rng, self.rl_step)
                done = None
                if samples:
                    done = self.trainer.train_step(samples, self.cfg.spot_micro_tokens, stop=lambda: not self._go.is_set())
                    self.steps_this_rl_step += done is not None
                took = self.clock() - t
                self.used_s += took
                self.last_step_s = took if done is not None else self.last_step_s
                # stop before a step that would run over the share
                if self.used_s + self.last_step_s > self.allowed_s or not samples:
                    self._go.clear()
            except Exception as e:  # a failing drafter step must not take the RL run down
                log.warning("spot drafter training failed and is off for this run: %s", e)
                self.error = f"{type(e).__name__}: {e}"
                self._go.clear()
            finally:
                self._idle.set()


class SpotLender:
    """Lends rollout threads to a SpotTrainer during the long tail of a rollout.

    The caller reports each engine step: how many sequences still run and the completions that finished
    (their hidden states feed the drafter buffer, tagged by RL step; errors are skipped). The long tail is
    `engine.tail.in_tail` of the rollout's sequences (`begin_step` sets their number). Invariants: threads are lent (the rollout runs on `threads - spot_threads`)
    only while the spot trainer runs; when the batch grows, the trainer stops itself or `stop()` is called,
    the spot trainer is paused (waiting for its micro-batch in progress) and the rollout gets every thread back."""

    def __init__(self, spot: SpotTrainer, buffer: DraftBuffer, cfg: DrafterConfig, n_seqs: int = 0,
                 threads: int | None = None):
        self.spot, self.buffer, self.cfg, self.n_seqs = spot, buffer, cfg, n_seqs
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.lent = False
        self.rl_step = 0

    def begin_step(self, rl_step: int, last_step_s: float, n_seqs: int | None = None) -> None:
        """n_seqs: the coming rollout's sequences (where its tail begins); None keeps the last rollout's."""
        self.rl_step = rl_step
        if n_seqs is not None:
            self.n_seqs = n_seqs
        self.spot.begin_step(rl_step, last_step_s)

    def on_engine_step(self, num_running: int, finished: list) -> None:
        """finished: Completions (prompt_token_ids, token_ids, hidden_states [prompt + output - 1, H] or None)."""
        self.buffer.add_completions(finished, self.rl_step)
        tail = in_tail(num_running, self.n_seqs)
        if tail and not self.spot.running and not self.lent and self.spot.resume():
            torch.set_num_threads(max(self.threads - self.cfg.spot_threads, 1))
            self.lent = True
        elif self.lent and not (tail and self.spot.running):  # the batch grew, or the trainer spent its share
            self.stop()

    def stop(self) -> None:
        """Waits for the spot trainer's micro-batch in progress, then gives the rollout its threads back."""
        self.spot.pause(wait=True)
        torch.set_num_threads(self.threads)
        self.lent = False
