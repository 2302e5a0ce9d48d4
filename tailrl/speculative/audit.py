"""Losslessness audit: does an engine's speculative decoding sample what its plain decoding samples?

Lossless SD (Leviathan et al. 2023; Chen et al. 2023) emits draws from exactly the target's distribution, so the
responses of one prompt are identically distributed with SD on and off. The audit samples the same prompts in
both arms, with independent seeds, at each temperature, and tests two consequences of that:

- the token at each of the first `positions` output positions (a response that ended earlier counts as `<end>`):
  per prompt a 2 x K contingency table (arm x token), tokens whose pooled count is below `min_count` merged into
  one bin (and that bin into the smallest if it is still small), Pearson's chi-square summed over prompts (each
  prompt's table is independent, so the sum is chi-square with the summed degrees of freedom);
- the response lengths, pooled over prompts (both arms draw the same number per prompt, so under losslessness the
  pooled lengths share one mixture distribution): the two-sample Kolmogorov-Smirnov test;
- given a target scorer, every token of the speculative arm: none may have a target log p below the floor a
  lossless sampler reaches with probability <= its share of alpha, and reported logprobs must match the target's
  within `logprob_tol` (speculative/impossible.py). This is what catches one wrong token in hundreds.

The first output token comes from the prefill in most engines and is drafted by none, so it checks the harness
(same prompts, same warping); the later positions and the lengths are where a lossy acceptance shows.

False-alarm rate: every test is run at alpha / (number of tests) (Bonferroni; per temperature the chi-squares,
the KS and the token test), so a lossless engine fails the audit with probability at most `alpha` (0.01 by
default), whatever the correlation between the tests. The KS
p-value is conservative where lengths tie (max_tokens), which only lowers that rate."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

from .impossible import TargetScorer, check_tokens

#: bumped when what the audit checks changes: cached verdicts of another version are not trusted
AUDIT_VERSION = 2

#: sample(prompts, temperature, n, max_tokens, seed) -> per prompt, n responses as token id lists (or Responses)
Sampler = Callable[[list, float, int, int, int], list]


class Response(list):
    """A response's token ids (a list, as the distribution tests read it) with the logprobs the engine reported
    for them under the distribution it sampled from (None where it reports none) and, for a tool trajectory, its
    response mask (0: an observation's or template's token, which the engine did not sample and the token test does
    not score; None: every token sampled)."""

    def __init__(self, tokens, logprobs=None, mask=None):
        super().__init__(tokens)
        self.logprobs = None if logprobs is None else [float(x) for x in logprobs]
        self.mask = None if mask is None else [int(m) for m in mask]


@dataclass
class AuditConfig:
    temperatures: tuple[float, ...] = (0.7, 1.0)
    # responses per prompt, per arm and temperature: few prompts with many responses each, as the token tests are
    # per prompt (4 x 64 catches a top token going from 0.4 to 0.7, or mean length halved, in 40 of 40 seeded audits)
    n: int = 64
    max_tokens: int = 64
    positions: int = 4  # chi-square on the tokens at output positions 0 .. positions-1
    min_count: int = 10  # a token bin pooled over both arms below this joins the merged bin (expected >= 5 per arm)
    alpha: float = 0.01  # family-wise false-alarm rate of the whole audit
    seed: int = 0
    # bound on |reported - target logprob| (arithmetic noise, not a test): fp32 against fp32; tol_for() for bf16
    logprob_tol: float = 0.05

    def __post_init__(self):
        self.temperatures = tuple(float(t) for t in self.temperatures)
        if not self.temperatures or any(t <= 0 for t in self.temperatures):
            raise ValueError(f"audit temperatures={self.temperatures}: each must be > 0 (greedy draws nothing to test)")
        if self.n < 8:
            raise ValueError(f"audit n={self.n}: at least 8 responses per prompt and arm are needed for the tests")
        if not 0 < self.alpha < 1:
            raise ValueError(f"audit alpha={self.alpha} must be in (0, 1)")
        if self.positions < 1 or self.max_tokens < self.positions:
            raise ValueError(f"audit positions={self.positions} must be in [1, max_tokens={self.max_tokens}]")

    @property
    def num_tests(self) -> int:
        """Per temperature: one chi-square per position, the length KS, the token test (counted where not run)."""
        return len(self.temperatures) * (self.positions + 2)


def tol_for(*dtypes: str) -> float:
    """AuditConfig.logprob_tol where the engine and the scorer run in these dtypes: 0.05 in fp32 (two fp32
    implementations agreed to 1e-3 on the models here), 3.0 where either is 16-bit (8 or 11 bits of mantissa:
    a logit of 30 is rounded by up to 0.12 at the output alone, and each layer adds its own). Lossy samplers
    misreported by 72-96 (benchmarks/RESULTS.md section 18)."""
    return 0.05 if all(str(d).removeprefix("torch.") == "float32" for d in dtypes) else 3.0


@dataclass
class AuditRow:
    temperature: float
    token_chi2: list[float]  # per position: the chi-square statistic summed over prompts
    token_df: list[int]
    token_p: list[float]
    length_ks: float
    length_p: float
    mean_len_off: float
    mean_len_on: float
    # the token test on the speculative arm (speculative/impossible.py); None where no scorer was given
    scored: int | None = None
    impossible: int | None = None
    worst_logp: float | None = None
    floor: float | None = None
    logprob_err: float | None = None  # None also where the engine reported no logprobs
    logprob_tol: float | None = None

    @property
    def min_p(self) -> float:
        return min(self.token_p + [self.length_p])

    def ok(self, threshold: float) -> bool:
        return (self.min_p >= threshold and not self.impossible
                and (self.logprob_err is None or self.logprob_err <= self.logprob_tol))

    def failures(self, threshold: float) -> list[str]:
        """What failed at this temperature, each with its figures (empty where the row passes)."""
        out = [f"tokens at position {j}: chi-square p {p:.2g}" for j, p in enumerate(self.token_p) if p < threshold]
        if self.length_p < threshold:
            out.append(f"lengths: KS p {self.length_p:.2g} (mean {self.mean_len_off:.1f} off, "
                       f"{self.mean_len_on:.1f} on)")
        if self.impossible:
            out.append(f"{self.impossible} of {self.scored} tokens below target log p {self.floor:.1f} "
                       f"(lowest {self.worst_logp:.1f})")
        if self.logprob_err is not None and self.logprob_err > self.logprob_tol:
            out.append(f"reported logprobs up to {self.logprob_err:.3g} off the target's (bound {self.logprob_tol:g})")
        return out

    def token_figures(self) -> str:
        if self.scored is None:
            return "tokens not scored"
        err = "no logprobs reported" if self.logprob_err is None else f"max logprob error {self.logprob_err:.3g}"
        return (f"{self.impossible} of {self.scored} tokens below target log p {self.floor:.1f} "
                f"(lowest {self.worst_logp:.1f}), {err}")


@dataclass
class AuditResult:
    passed: bool
    threshold: float  # each test's p-value must be at least this (alpha / number of tests)
    rows: list[AuditRow] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    label: str = ""

    def figures(self) -> str:
        """One line: the smallest p-values and mean lengths, per temperature (what a warning names)."""
        return "; ".join(f"T={r.temperature:g}: token p={min(r.token_p):.2g}, length KS p={r.length_p:.2g} "
                         f"(mean length off {r.mean_len_off:.1f}, on {r.mean_len_on:.1f}), {r.token_figures()}"
                         for r in self.rows)

    def verdict(self) -> str:
        """PASS or FAIL, what each test must meet, and per temperature what failed with its figures."""
        cfg = self.config
        rule = (f"each test's p >= {self.threshold:.2g} (a lossless engine fails with probability <= "
                f"{cfg.get('alpha', 0.01):g}), no SD token below the target's floor, reported logprobs within "
                f"{cfg.get('logprob_tol', 0.05):g} of the target's")
        lines = [f"{'PASS' if self.passed else 'FAIL'}: {rule}"]
        for r in self.rows:
            why = r.failures(self.threshold)
            lines.append(f"  T={r.temperature:g}: " + ("; ".join(why) if why else "pass"))
        return "\n".join(lines)

    def table(self) -> str:
        k = len(self.rows[0].token_chi2) if self.rows else 0
        head = (f"| arm | T | token chi2/df (positions 0-{k - 1}) | min token p | length KS | length p | "
                "mean len off / on | tokens below floor / scored | floor | lowest target log p | max logprob error | "
                "verdict |")
        lines = [head, "|" + "---|" * 12]
        for r in self.rows:
            # "-": one token bin per prompt at that position (nothing to compare: near-deterministic there)
            chi = ", ".join(f"{c:.0f}/{d}" if d else "-" for c, d in zip(r.token_chi2, r.token_df))
            verdict = "pass" if r.ok(self.threshold) else "FAIL"
            if r.scored is None:
                tok = "- | - | - | -"
            else:
                err = "-" if r.logprob_err is None else f"{r.logprob_err:.3g}"
                tok = f"{r.impossible} / {r.scored} | {r.floor:.1f} | {r.worst_logp:.1f} | {err}"
            min_p = f"{min(r.token_p):.2g}" if any(r.token_df) else "-"
            lines.append(f"| {self.label} | {r.temperature:g} | {chi} | {min_p} | {r.length_ks:.3f} | "
                         f"{r.length_p:.2g} | {r.mean_len_off:.1f} / {r.mean_len_on:.1f} | {tok} | {verdict} |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AuditResult":
        return cls(d["passed"], d["threshold"], [AuditRow(**r) for r in d["rows"]], d.get("config", {}), d.get("label", ""))


END = -1  # the bin of a response that ended before the position


def token_chi2(off: list[list[list[int]]], on: list[list[list[int]]], position: int, min_count: int):
    """(statistic, df, p) of arm x token at one output position, summed over prompts."""
    from scipy.stats import chi2, chi2_contingency

    stat, df = 0.0, 0
    for a, b in zip(off, on):
        ca = Counter(r[position] if len(r) > position else END for r in a)
        cb = Counter(r[position] if len(r) > position else END for r in b)
        keep = sorted(t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= min_count)
        rest_a = sum(ca.values()) - sum(ca[t] for t in keep)
        rest_b = sum(cb.values()) - sum(cb[t] for t in keep)
        cols = [[ca[t], cb[t]] for t in keep]
        if rest_a + rest_b:
            if rest_a + rest_b >= min_count or not cols:
                cols.append([rest_a, rest_b])
            else:  # a small merged bin joins the smallest kept one
                small = min(cols, key=sum)
                small[0], small[1] = small[0] + rest_a, small[1] + rest_b
        if len(cols) < 2:
            continue  # one bin: nothing to compare at this prompt
        s, _, d, _ = chi2_contingency([[c[0] for c in cols], [c[1] for c in cols]], correction=False)
        stat, df = stat + float(s), df + int(d)
    return stat, df, float(chi2.sf(stat, df)) if df else 1.0


def compare(off: list[list[list[int]]], on: list[list[list[int]]], temperature: float, cfg: AuditConfig) -> AuditRow:
    """The tests of one temperature on responses already drawn (per prompt, a list of token id lists per arm)."""
    from scipy.stats import ks_2samp

    if len(off) != len(on) or any(len(a) != len(b) for a, b in zip(off, on)):
        raise ValueError("audit arms must hold the same number of responses per prompt")
    chis = [token_chi2(off, on, j, cfg.min_count) for j in range(cfg.positions)]
    la = [len(r) for a in off for r in a]
    lb = [len(r) for b in on for r in b]
    ks = ks_2samp(la, lb)
    return AuditRow(temperature, [c[0] for c in chis], [c[1] for c in chis], [c[2] for c in chis],
                    float(ks.statistic), float(ks.pvalue), sum(la) / len(la), sum(lb) / len(lb))


def context_needed(prompts: list[list[int]], max_tokens: int, context: int) -> int:
    """The context an audit of `prompts` at `max_tokens` needs (its engines' max_model_len): the longest prompt plus
    max_tokens. An engine given less would stop responses early (the length test would compare truncated lengths)
    or refuse the prompts, so more than the model's `context` is an error naming the figures."""
    if not prompts:
        raise ValueError("audit needs at least one prompt")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > context:
        raise ValueError(f"the audit's longest prompt ({longest} tokens) + max_tokens {max_tokens} = "
                         f"{longest + max_tokens} tokens exceed the model's context of {context}: lower max_tokens "
                         f"to at most {max(context - longest, 0)}")
    return longest + max_tokens


def draw(sample: Sampler, prompts: list[list[int]], cfg: AuditConfig, arm: int) -> list:
    """One arm's responses at every temperature (arm 0: SD off, 1: SD on; the arms' seeds differ, so that an engine
    whose SD emits the very tokens of its plain decoding is tested like any other and the false-alarm rate stays
    alpha). An engine can then be built, drawn from and freed one arm at a time."""
    if not prompts:
        raise ValueError("audit needs at least one prompt")
    return [sample(prompts, t, cfg.n, cfg.max_tokens, cfg.seed + 2 * i + arm * 1_000_003)
            for i, t in enumerate(cfg.temperatures)]


def score_arm(on: list, prompts: list[list[int]], cfg: AuditConfig, scorer: TargetScorer) -> list:
    """The token test (speculative/impossible.py) of one arm's draws, per temperature, at the Bonferroni share."""
    a = cfg.alpha / cfg.num_tests
    return [check_tokens(prompts, per_t, t, scorer, len(prompts) * cfg.n * cfg.max_tokens, a)
            for per_t, t in zip(on, cfg.temperatures)]


def judge(off: list, on: list, cfg: AuditConfig, label: str = "", checks: list | None = None) -> AuditResult:
    """Pass or fail from both arms' draws (`draw`) and, where given, the speculative arm's token checks
    (`score_arm`); without them only the distribution tests decide (and the table says the tokens were not scored)."""
    rows = [compare(a, b, t, cfg) for a, b, t in zip(off, on, cfg.temperatures)]
    for r, c in zip(rows, checks or []):
        r.scored, r.impossible, r.worst_logp, r.floor = c.scored, c.impossible, c.worst_logp, c.floor
        r.logprob_err, r.logprob_tol = c.logprob_err, cfg.logprob_tol
    threshold = cfg.alpha / cfg.num_tests
    return AuditResult(all(r.ok(threshold) for r in rows), threshold, rows, asdict(cfg), label)


def audit(off: Sampler, on: Sampler, prompts: list[list[int]], cfg: AuditConfig | None = None,
          label: str = "", scorer: TargetScorer | None = None) -> AuditResult:
    """Samples `prompts` with plain decoding (`off`) and with SD (`on`) at each temperature and tests that both
    arms draw from one distribution and, given the target's scorer, that SD emitted no token the target rules out."""
    cfg = cfg or AuditConfig()
    off_draws, on_draws = draw(off, prompts, cfg, 0), draw(on, prompts, cfg, 1)
    checks = score_arm(on_draws, prompts, cfg, scorer) if scorer is not None else None
    return judge(off_draws, on_draws, cfg, label, checks)
