"""Our history proposer as vLLM drives it (rollout/vllm/proposer.py), without vLLM: vLLM's calls are simulated
with its arrays (sampled tokens per row, tokens per row, the token table). Rows find their prompt by prefix, a row
that vLLM moves keeps its stream (nothing indexed twice), drafts come from an earlier epoch's responses, and what
was verified calibrates the acceptance estimates. The proposer inside a real vLLM: tests/rollout/vllm_checks.py."""

from types import SimpleNamespace

import numpy as np

from tailrl.rollout.vllm.proposer import HistoryProposer

K = 4
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 5, 6, 7, 8, 9, 10, 11, 40, 41]]  # the same first 8 tokens


def proposer(monkeypatch) -> HistoryProposer:
    monkeypatch.delenv("TAILRL_VLLM_ARM", raising=False)
    monkeypatch.delenv("TAILRL_VLLM_TRACE", raising=False)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K))
    p = HistoryProposer(cfg)
    p.push_prompts(PROMPTS)
    return p


class Batch:
    """vLLM's token table for running requests: row -> prompt + tokens so far."""

    def __init__(self, seqs: list[list[int]]):
        self.seqs = [list(s) for s in seqs]

    def call(self, p: HistoryProposer, sampled: list[list[int]]) -> list[list[int]]:
        for s, new in zip(self.seqs, sampled):
            s.extend(new)
        width = max(len(s) for s in self.seqs) + 8
        table = np.zeros((len(self.seqs), width), dtype=np.int64)
        for i, s in enumerate(self.seqs):
            table[i, : len(s)] = s
        return p.propose(sampled, np.array([len(s) for s in self.seqs]), table)


def live_streams(p: HistoryProposer) -> int:
    return sum(len(ph.live) for ph in p.prompts.values())


def test_rows_find_their_prompt_and_keep_their_stream_when_vllm_moves_them(monkeypatch):
    p = proposer(monkeypatch)
    b = Batch([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    b.call(p, [[20], [30], [50]])
    assert [p.rows[i][0] for i in range(3)] == [tuple(PROMPTS[0]), tuple(PROMPTS[1]), tuple(PROMPTS[0])]
    for t in range(3):
        b.call(p, [[21 + t], [31 + t], [51 + t]])
    assert live_streams(p) == 3
    streams = {i: p.rows[i][:2] for i in range(3)}
    # row 0 finishes; vLLM moves its last row into the hole (as its input batch condenses)
    b.seqs = [b.seqs[2], b.seqs[1]]
    b.call(p, [[60], [40]])
    assert live_streams(p) == 2 + 1  # the finished row's stream stays; no new one for the moved row
    assert p.rows[0][:2] == streams[2] and p.rows[1][:2] == streams[1]
    ph = p.prompts[tuple(PROMPTS[0])]
    assert ph.index.streams[streams[2][1]][-5:] == [50, 51, 52, 53, 60]  # its tokens, each indexed once


def test_drafts_come_from_the_last_epoch_and_verification_calibrates_them(monkeypatch):
    p = proposer(monkeypatch)
    response = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    b = Batch([PROMPTS[0]])
    b.call(p, [[response[0]]])
    for t in response[1:]:
        b.call(p, [[t]])
    p.end_rollout()  # the response is history now
    b = Batch([PROMPTS[0]])
    drafts = b.call(p, [[response[0]]])
    # before the step line is known, a batch of one drafts the likely tokens: the history's continuation
    assert drafts[0] and drafts[0] == response[1 : 1 + len(drafts[0])] and len(drafts[0]) <= K
    est_before = p.calib(np.ones(K)).copy()
    drafts = b.call(p, [response[1 : 1 + len(drafts[0])] + [99]])  # all accepted, then a bonus token 99
    cells = p.calib.tried.sum()
    assert cells > 0 and p.calib.accepted.sum() == cells  # every verified draft token counted as accepted
    assert np.all(p.calib(np.ones(K)) >= est_before - 1e-12)


def test_repeat_arm_drafts_k_tokens_for_every_row_history_or_not(monkeypatch):
    proposer(monkeypatch)  # the environment cleared
    monkeypatch.setenv("TAILRL_VLLM_ARM", "repeat:3")
    p = HistoryProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K)))
    b = Batch([[1, 2, 3], [4, 5]])  # prompts it was never given: no history, no match
    assert b.call(p, [[7], [9]]) == [[7, 7, 7], [9, 9, 9]]
    assert b.call(p, [[8, 8], []]) == [[8, 8, 8], []]  # a row that emitted nothing this step drafts nothing
    assert p.stats["drafted"] == 9 and not p.pending


def test_a_later_turn_drafts_from_that_turn_of_its_prompt_in_the_last_epoch(monkeypatch):
    """An agent's turn 1 (its prompt: the trajectory's prompt + turn 0 + the observation, pushed with history
    (prompt, 1) as rollout/vllm/turns.py pushes it) lands in its turn 0's row: it is matched to its own request, not
    taken for a continuation of turn 0, whose stream keeps turn 0's tokens only. Next epoch, turn 1 of the same prompt
    after another turn 0 drafts from last epoch's turn 1, and the counters of later turns say so."""
    p = proposer(monkeypatch)
    P, obs, turn1 = PROMPTS[0], [60, 61], list(range(30, 40))
    for epoch, turn0 in enumerate(([20, 21, 22], [25, 26, 27])):
        if epoch:
            p.push_prompts([P])  # io.draw and vllm/turns.py push a rollout's prompts again
        b = Batch([P])
        for t in turn0:
            b.call(p, [[t]])
        stream0 = p.rows[0][:2]
        T1 = P + turn0 + obs
        p.push_prompts([T1], [(P, 1)])
        b.seqs = [list(T1)]  # the finished turn's row, reused by the next turn's request
        if epoch == 0:
            for t in turn1:
                b.call(p, [[t]])
            assert p.rows[0][0] == tuple(T1)
            ph0, ph1 = p.prompts[tuple(P)], p.prompts[(tuple(P), 1)]
            assert ph0.index.streams[stream0[1]] == P[-4:] + turn0  # turn 0's tokens only
            assert ph1.index.streams[p.rows[0][1]] == P[-4:] + turn1  # turn 1's, after the prompt's tail
            assert p.end_rollout()["later_drafted"] == 0  # nothing in its history yet
            continue
        b.call(p, [[30]])
        drafts = b.call(p, [[31]])  # two tokens of context: a match in last epoch's turn 1
        assert drafts[0] and drafts[0] == turn1[2 : 2 + len(drafts[0])]
        b.call(p, [drafts[0] + [99]])  # every draft accepted, then a bonus token
        stats = p.end_rollout()
        assert stats["later_drafted"] >= len(drafts[0]) and stats["later_accepted"] == len(drafts[0])
