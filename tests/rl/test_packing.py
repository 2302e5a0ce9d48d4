"""A prompt's samples share one copy of the prompt in the update's forward (rl/actor/packing.py): each member's token
logprobs, entropies and the gradient of a PPO loss equal those of one padded full-logits forward over separate
sequences, while the forward computes fewer tokens; mini-batches keep a group's samples together."""

import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tailrl.config import AlgoCfg
from tailrl.rl.actor.forward import make_batch, micro_batches, sequence_logprobs
from tailrl.rl.actor.packing import layout, packed_tokens
from tailrl.rl.actor.update import update_plan
from tests.helpers import tiny_model
from tests.rl.update_helpers import VALUE_TOL, assert_micro_batches_match_padded, padded_reference


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", dtype=torch.float32).requires_grad_(True)


def group_comps(seed: int = 0, prompts: int = 3, n: int = 4):
    """n samples per prompt, prompt-major, with a 1-token response and an empty one among them."""
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(3, 96) for _ in range(rng.randint(4, 10))]
        for k in range(n):
            n_resp = 1 if (g, k) == (0, 1) else 0 if (g, k) == (1, 2) else rng.randint(2, 15)
            resp = [rng.randrange(3, 96) for _ in range(n_resp)]
            out.append(SimpleNamespace(prompt_token_ids=list(prompt), token_ids=resp, logprobs=[-2.0] * n_resp))
    return out


def test_layout_packs_rows_and_hides_siblings():
    batch = make_batch(group_comps(prompts=1, n=3), pad=0)
    T = batch.mask.shape[1]
    lay = layout(batch.seqs, batch.prompt_lens, batch.groups, [0, 1, 2], batch.start, T, "cpu")
    p = batch.prompt_lens[0]
    r = [len(s) - p for s in batch.seqs]
    assert r[1] == 1  # member 1 has one token: it adds no row, its token is predicted from the prompt's last
    assert lay.tokens.tolist() == batch.seqs[0][:p] + batch.seqs[0][p:-1] + batch.seqs[2][p:-1]
    assert lay.computed == len(lay.tokens) == p + (r[0] - 1) + (r[2] - 1)
    assert lay.positions.tolist() == list(range(p)) + list(range(p, p + r[0] - 1)) + list(range(p, p + r[2] - 1))
    sh = lay.shared
    assert (sh.S, sh.P, sh.M, sh.R) == (1, p, 3, max(r) - 1) and sh.seg_of.tolist() == [0, 0, 0]
    assert sh.r_idx.tolist() == list(range(r[0] - 1)) + list(range(2 * sh.R, 2 * sh.R + r[2] - 1))
    m = sh.mask[2, 0]  # member 2: the whole prompt, its own keys causally
    assert bool(m[:, :p].all()) and torch.equal(m[:, p:], torch.ones(sh.R, sh.R, dtype=torch.bool).tril())
    first = [0, r[0], r[0] + r[1]]
    assert [int(lay.rows[k]) for k in first] == [p - 1] * 3  # every first token from the prompt's last row
    assert lay.targets.tolist() == sum((s[p:] for s in batch.seqs), [])


def test_shared_prompt_forward_equals_separate_sequences_values_and_gradients(tiny):
    batch = make_batch(group_comps(), pad=0)
    B = len(batch)
    idx = list(range(B))
    adv = torch.randn(B, generator=torch.Generator().manual_seed(3))
    micros = micro_batches(batch, idx, 4)
    assert len(micros) == 3 and all(len(m) == 4 and len({batch.groups[i] for i in m}) == 1 for m in micros)
    assert packed_tokens(batch.seqs, batch.prompt_lens, batch.groups, idx) < batch.tokens
    assert_micro_batches_match_padded(tiny, batch, micros, adv, chunk=5)


def test_groups_cut_and_mixed_across_micro_batches(tiny):
    """Micro-batches of 3 over groups of 4: each group is cut into 3 + 1 samples, and the single samples of
    different prompts share a micro-batch (padded segment rows, one of them causal only)."""
    batch = make_batch(group_comps(seed=5, prompts=3, n=4), pad=0)
    ref_lp, _ = padded_reference(tiny, batch, 1.0)
    micros = micro_batches(batch, list(range(len(batch))), 3)
    assert sorted(i for m in micros for i in m) == list(range(len(batch))) and max(map(len, micros)) <= 3
    assert any(len({batch.groups[i] for i in m}) == 3 for m in micros)
    assert all(sum(batch.groups[i] == g for m in micros for i in m) == 4 for g in range(3))
    with torch.no_grad():
        for micro in micros:
            lp, _ = sequence_logprobs(tiny, batch, micro, 1.0)
            torch.testing.assert_close(lp, ref_lp[micro], atol=VALUE_TOL, rtol=0)


def test_mini_batches_keep_a_groups_samples_together():
    groups = [g for g in range(6) for _ in range(4)]
    algo = AlgoCfg(mini_batch_size=8, micro_batch_size=4, ppo_epochs=2)
    minis, live = update_plan(groups, torch.ones(24), algo, random.Random(0), has_ref=False)
    assert len(minis) == 6 and all(live)
    for e in range(2):
        epoch = minis[3 * e : 3 * e + 3]
        assert sorted(i for m in epoch for i in m) == list(range(24))
        for m in epoch:  # two whole groups per mini-batch
            assert sorted(Counter(groups[i] for i in m).values()) == [4, 4]
    assert minis[:3] != minis[3:]  # each epoch shuffles the groups' order


def test_the_shared_prompt_backward_is_the_same_bits_every_time_at_two_threads(tiny):
    """A prompt's samples gather its keys and values; the backward sums those gradients. Advanced indexing's backward
    (index_put_ with accumulate) adds floats atomically in thread order on a CPU at 2+ threads where indices repeat,
    so the update's gradients, and a resumed run's weights, differed run to run in the last bits (AVX2 Zen 3 and
    AVX-512 Zen 4 alike). index_select's backward sums in index order: every backward gives the same bits."""
    rng = random.Random(7)
    comps = []  # a long prompt, 48 samples: the gathered gradient is far above torch's grain size, and both threads
    prompt = [rng.randrange(3, 96) for _ in range(160)]  # add into the same prompt's rows at once
    for _ in range(48):
        resp = [rng.randrange(3, 96) for _ in range(rng.randint(2, 12))]
        comps.append(SimpleNamespace(prompt_token_ids=prompt, token_ids=resp, logprobs=[-2.0] * len(resp)))
    batch = make_batch(comps, pad=0)
    idx = list(range(len(batch)))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = set()
        for _ in range(12):
            tiny.zero_grad(set_to_none=True)
            lp, _ = sequence_logprobs(tiny, batch, idx, 1.0)
            (lp * batch.mask).sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in tiny.parameters() if p.grad is not None))
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1
