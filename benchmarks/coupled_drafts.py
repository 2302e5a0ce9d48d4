"""Coupled drafts against most-frequent drafts, offline, on the responses of one real rollout.

Runs one rollout with SD off and records every sequence: its seed, prompt and output. The rollout is the first
rollout of a preset, or with --run the step after a run's checkpoint. Then each response is decoded again on paper
with the sequence's own n-gram drafter, one verify step at a time. The recorded tokens are the verifier's draws
(the noise is keyed by seed and position), so a draft is accepted exactly as far as it matches them, and a step
emits the match plus one token. No model runs here. The drafters compared:
- `most frequent`: the continuation of the longest match (the n-gram drafter before session 18; greedy requests);
- `coupled, exact`: speculative/backoff.py's chains drawn with the verifier's noise, exact contexts only;
- `coupled, classes`: the same with number classes, and the template level's repeating columns (they need no
  digits);
- `+ counting columns`: the same with the digit tokens, so that the template level also counts (what sampled
  requests draft now).

The slowest response decides when a rollout ends, so the table gives the most steps any response needed beside the
mean tokens per step.

    .venv/bin/python benchmarks/coupled_drafts.py [--preset long] [--seeds 0 1] [--run RUN_DIR] [--depths 3 7]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from types import SimpleNamespace

from tailrl.config import load_config
from tailrl.engine.sequence import Sequence
from tailrl.speculative.backoff import digit_values, number_classes
from tailrl.speculative.config import SpecConfig
from tailrl.speculative.drafters import NgramDrafter


def record_rollout(preset: str, seed: int, run: Path | None) -> tuple[list[tuple[int, list[int], list[int]]], object]:
    """(seed, prompt ids, output ids) of every sequence of one SD-off rollout, and the tokenizer."""
    from tailrl.rl.trainer import Trainer

    seen = []
    to_completion = Sequence.to_completion

    def record(self):
        seen.append((self.seed, list(self.prompt_ids), list(self.output_ids)))
        return to_completion(self)

    Sequence.to_completion = record
    try:
        if run is None:
            cfg = load_config(None, ["rollout.spec.mode=off", f"trainer.seed={seed}", "trainer.overwrite=true",
                                     f"trainer.out_dir=/tmp/tailrl-coupled/{preset}-{seed}"], preset=preset)
        else:
            cfg = load_config(str(run / "config.json"), ["rollout.spec.mode=off", "trainer.resume=true",
                                                         "trainer.overwrite=false", f"trainer.out_dir={run}"])
        tr = Trainer(cfg)
        if run is not None:
            tr.resume()
        examples = [tr.train_set[i] for i in tr.loader.next(cfg.trainer.prompts_per_step)]
        tr.rollout(examples, tr.step + 1 if run is None else tr.step)
        tokenizer = tr.tokenizer
        tr.close()
    finally:
        Sequence.to_completion = to_completion
    return seen, tokenizer


def steps_needed(seqs, depth: int, coupled: bool, classes: dict[int, int],
                 digits: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """(response length, verify steps) per response, drafting `depth`-token chains at every step."""
    out = []
    for seed, prompt, output in seqs:
        drafter = NgramDrafter(SpecConfig(coupled=coupled))
        drafter.chains, drafter.classes, drafter.digits = True, classes, digits or {}
        s = SimpleNamespace(seq_id=0, seed=seed, prompt_ids=prompt, output_ids=output[:1],
                            params=SimpleNamespace(greedy=False))
        drafter.start(s)
        t, steps = 1, 0  # the first token comes from the prefill
        while t < len(output):
            k = min(depth, len(output) - t - 1)
            tree = drafter.propose_one(s, k, k) if k > 0 else None
            a = 0
            while tree is not None and a < len(tree.tokens) and tree.tokens[a] == output[t + a]:
                a += 1
            new = output[t : t + a + 1]
            s.output_ids = output[: t + len(new)]
            drafter.accept(s, new)
            t += len(new)
            steps += 1
        out.append((len(output), steps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="long")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--run", type=Path, default=None, help="replay the step after this run's checkpoint instead")
    ap.add_argument("--depths", type=int, nargs="+", default=[3, 7])
    args = ap.parse_args()
    logging.getLogger("tailrl").setLevel(logging.ERROR)
    print("| rollout | depth | drafter | most steps of a response | tokens per step (all) | tokens per step (capped) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for seed in ([None] if args.run else args.seeds):
        seqs, tokenizer = record_rollout(args.preset, seed, args.run)
        classes, digits = number_classes(tokenizer), digit_values(tokenizer)
        cap = max(len(o) for _, _, o in seqs)
        name = str(args.run) if args.run else f"{args.preset} seed {seed}, first"
        for depth in args.depths:
            for label, coupled, cls, dig in (("most frequent", False, {}, {}), ("coupled, exact", True, {}, {}),
                                             ("coupled, classes", True, classes, {}),
                                             ("+ counting columns", True, classes, digits)):
                r = steps_needed(seqs, depth, coupled, cls, dig)
                capped = [x for x in r if x[0] == cap]
                per = lambda xs: sum(L for L, _ in xs) / max(1, sum(st for _, st in xs))
                print(f"| {name} | {depth} | {label} | {max(st for _, st in r)} | {per(r):.2f} | "
                      f"{per(capped):.2f} ({len(capped)} at {cap}) |", flush=True)


if __name__ == "__main__":
    main()
