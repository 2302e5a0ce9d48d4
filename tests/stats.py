"""Chi-square goodness of fit for sampled sequences against exact probabilities."""

from scipy.stats import chisquare


def chisquare_pvalue(counts: dict, probs: dict, min_expected: float = 5.0) -> float:
    """counts and probs keyed by outcome. Outcomes of probability 0 must never be observed; outcomes with
    an expected count below min_expected are pooled (and the pool joins the smallest cell if still small)."""
    n = sum(counts.values())
    for k, c in counts.items():
        assert probs.get(k, 0.0) > 0 or c == 0, f"{k} has probability 0 but was drawn {c} times"
    cells = sorted(((p * n, counts.get(k, 0)) for k, p in probs.items() if p > 0), reverse=True)
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for e, o in cells:
        if e >= min_expected:
            exp.append(e)
            obs.append(o)
        else:
            pool_e, pool_o = pool_e + e, pool_o + o
    if pool_e >= min_expected or not exp:
        exp.append(pool_e)
        obs.append(pool_o)
    else:
        exp[-1] += pool_e
        obs[-1] += pool_o
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)
