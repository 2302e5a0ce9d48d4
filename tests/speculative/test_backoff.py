"""Coupled drafting (speculative/backoff.py): chains drawn with the verifier's own noise from a backoff model of the text."""

import math

import torch

from tailrl.speculative.backoff import NUMBER, SPACED_NUMBER, BackoffModel, coupled_chain, digit_values, number_classes, token_classes
from tailrl.speculative.noise import draw

V = 32
A, E, X = 20, 21, 22  # a separator, an end-of-line and a line-start token; 1..9 play digits
DIGITS = list(range(1, 10))


def flat_policy(tokens) -> torch.Tensor:
    logp = torch.full((V,), -math.inf)
    logp[list(tokens)] = -math.log(len(tokens))
    return logp


def test_a_coupled_chain_agrees_with_the_verifier_wherever_its_estimate_is_the_policy():
    """Text where A is followed by each digit equally often and a digit by A: the unigram estimate after A is the
    policy's flat distribution exactly, so every drafted digit must be the verifier's draw at its own output
    position (position, position + 2, ...), whatever the seed. A most-frequent draft agrees 1 time in 9."""
    text = [t for _ in range(3) for d in DIGITS for t in (A, d)]
    model = BackoffModel(text + [A], classes={}, max_n=1)
    plain_digits, agree, deterministic = flat_policy(DIGITS), 0, 0
    trials = 200
    for seed in range(trials):
        position = 17 + seed % 5
        chain = coupled_chain(model, 5, seed, position, "ngram")
        assert chain is not None and len(chain) == 5 and chain.tokens[1::2] == [A, A]
        draws = [draw(plain_digits, seed, position + k) for k in (0, 2, 4)]
        agree += chain.tokens[0::2] == draws
        deterministic += draws[0] == DIGITS[0]  # the most frequent continuation (all tie: the first seen)
    assert agree == trials, f"coupled chains agreed with the verifier's draws in {agree} of {trials} trials"
    assert deterministic < 0.25 * trials


def test_a_coupled_chain_agrees_more_often_than_a_most_frequent_draft_where_the_estimate_is_rough():
    """An estimate from few samples (the text's own digits after A, drawn from a skewed policy) is not the policy,
    yet the coupled draw agrees with the verifier far more often than the policy's own mode does (seeded; the
    margin is wide: 0.84 against 0.28 here)."""
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.03, 0.02])
    logp = torch.full((V,), -math.inf)
    logp[DIGITS] = probs.log()
    g = torch.Generator().manual_seed(0)
    sample = torch.multinomial(probs, 40, replacement=True, generator=g).tolist()
    model = BackoffModel([t for i in sample for t in (A, DIGITS[i])] + [A], classes={}, max_n=1)
    trials, coupled, mode = 400, 0, 0
    for seed in range(trials):
        x = draw(logp, seed, 5)
        coupled += coupled_chain(model, 1, seed, 5, "ngram").tokens[0] == x
        mode += x == DIGITS[0]
    assert coupled > 0.6 * trials and mode < 0.4 * trials, (coupled, mode)


def test_number_classes_carry_a_template_past_numbers_never_seen():
    """Lines X n n E with other numbers each time: after X 7 8 (digits never seen together, 8 never seen at all) no
    exact context matches, and only the class context (X, number, number) says E comes next."""
    text = [X, 1, 2, E, X, 3, 4, E, X, 5, 6, E, X, 7, 8]
    classes = {d: NUMBER for d in DIGITS}
    with_classes = BackoffModel(text, classes)
    q = with_classes.distribution(text)
    assert max(q, key=q.get) == E and q[E] > 0.5, q
    assert coupled_chain(with_classes, 2, seed=3, position=10, drafter="ngram").tokens[0] == E
    assert coupled_chain(BackoffModel(text, {}), 2, seed=3, position=10, drafter="ngram") is None
    # after X a number follows: its mass goes to the digits the text holds, as the estimate below spreads it
    q = with_classes.distribution(text + [E, X])
    assert set(q) <= set(DIGITS) | {E, X} and sum(q[d] for d in DIGITS if d in q) > 0.9


def test_the_model_counts_what_was_appended_since_the_last_query():
    model = BackoffModel([A, 1, A], {})
    assert model.distribution([A]) == {1: 1.0}
    model.extend([2, A, 2, A])
    q = model.distribution([A])
    assert math.isclose(q[2], 2 / 3) and math.isclose(q[1], 1 / 3)


class _Tokenizer:
    pieces = ["a", "5", "\u012012", "\u25817", "x9", "12a", "007"]

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_number_classes_of_a_tokenizer():
    assert number_classes(_Tokenizer()) == {1: NUMBER, 2: SPACED_NUMBER, 3: SPACED_NUMBER, 6: NUMBER}
    assert number_classes(None) == {}


def _counting_lines(start: int, lines: int) -> list[int]:
    """X d d E per line, the two digits counting up from `start` (1..9 stand for digits 1..9, 10 for 0)."""
    tok = lambda d: d if d else 10  # noqa: E731
    return [t for n in range(start, start + lines) for t in (X, tok(n // 10 % 10), tok(n % 10), E)]


def test_the_template_level_counts_a_column_to_a_digit_never_seen_after_its_context():
    """Lines that count (X 1 2 E, X 1 3 E, ..., X 1 8 E): after "X 1" the text has seen 2..8 follow, never 9, and
    every context of the text says one of those. The counting column says 8 + (8 - 7) = 9; with the digit tokens
    the estimate puts most of its mass there, without them 9 has none."""
    digits = {d: d for d in DIGITS} | {10: 0}
    classes = {t: NUMBER for t in digits}
    text = _counting_lines(12, 7) + [X, 1]
    counting = BackoffModel(text, classes, digits=digits)
    q = counting.distribution(text)
    assert max(q, key=q.get) == 9 and q[9] > 0.5, q
    assert 9 not in BackoffModel(text, classes).distribution(text)
    # the next line's carry: after X 1 9 E comes X 2 0 (a counting tens column predicts 1 + (1 - 1) = 1 there: the
    # column's step, not the carry, so a carry is one miss)
    q = counting.distribution(text + [9, E, X])
    assert max(q, key=q.get) == 1


def test_the_template_level_weighs_itself_by_how_often_it_held():
    """Two streams of the same template: in one the second digit counts, in the other it is random (the first digit
    is 1 in both, a column whose step 0 always holds). The weight of counting predictions is their hit rate over both
    columns: about 0.84 in the first, 0.67 in the second (seeded), and so is the guess's share of q."""
    digits = {d: d for d in DIGITS} | {10: 0}
    classes = {t: NUMBER for t in digits}
    g = torch.Generator().manual_seed(1)
    noise = [t for _ in range(12) for t in (X, 1, 1 + int(torch.randint(9, (1,), generator=g)), E)]
    counting, random_ = (BackoffModel(text + [X, 1], classes, digits=digits)
                         for text in (_counting_lines(11, 8), noise))
    q_count = counting.distribution(counting.tokens)  # counting is lazy: the hit rates are known after a query
    q_rand = random_.distribution(random_.tokens)
    assert counting.trust[0] > 0.8 and random_.trust[0] < 0.7, (counting.trust, random_.trust)
    guess = random_._template(random_._class_keys(random_.token_classes, len(random_.tokens)))
    assert guess is not None and q_rand[guess[0]] < 0.7 < 0.8 < max(q_count.values()), (q_count, q_rand)


def test_digit_values_of_a_tokenizer():
    assert digit_values(_Tokenizer()) == {1: 5, 3: 7}
    assert digit_values(None) == {}
    assert token_classes(_Tokenizer()) == (number_classes(_Tokenizer()), digit_values(_Tokenizer()))


def test_the_copy_level_continues_a_number_like_the_last_one_that_began_the_same():
    """After four lines "X 8 1 E" the text writes "X 8 4 2 6 E" and then "A 8": every exact context says 1 follows
    8 (four times to one), but the number being written continues like the most recent number that began with 8,
    so the copy level puts most of the mass on 4. Without number classes there is no copy level and 1 wins."""
    digits = {d: d for d in DIGITS}
    classes = {t: NUMBER for t in digits}
    text = [t for _ in range(4) for t in (X, 8, 1, E)] + [X, 8, 4, 2, 6, E, A, 8]
    q = BackoffModel(text, classes, digits=digits).distribution(text)
    assert max(q, key=q.get) == 4 and q[4] > 0.5, q
    q = BackoffModel(text, {}).distribution(text)
    assert max(q, key=q.get) == 1, q
