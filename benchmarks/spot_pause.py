"""The spot trainer's timing on this machine, which the tests check in steps and events only
(tests/drafter/test_drafter.py): how long `pause(wait=True)` takes to be acknowledged (at most the micro-batch in
progress, `drafter.spot_micro_tokens`), and how much of its share (`drafter.spot_share` of the previous RL
step's time) it uses before it stops by itself.

    python benchmarks/spot_pause.py [--pauses 20] [--micro-tokens 256] [--share-s 2.0]

Run it alone (two torch processes on 2 cores oversubscribe the CPU)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailrl.drafter import DrafterConfig, EagleDrafter  # noqa: E402
from tailrl.drafter.eagle import choose_vocab  # noqa: E402
from tailrl.drafter.offline import collect  # noqa: E402
from tailrl.drafter.train import DrafterTrainer, SpotTrainer  # noqa: E402
from tailrl.model import load_model  # noqa: E402
from tailrl.tasks import chat_prompt  # noqa: E402
from tailrl.tasks import make_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pauses", type=int, default=20)
    ap.add_argument("--micro-tokens", type=int, default=DrafterConfig.spot_micro_tokens)
    ap.add_argument("--share-s", type=float, default=2.0, help="seconds of training the share allows")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m")
    prompts = [chat_prompt(r["prompt"]) for r in make_rows("arithmetic", 16, 7)]
    buffer = collect(model, tok, prompts, n=2, max_tokens=64, temperature=1.0, seed=0)
    cfg = DrafterConfig(spot_share=1.0, spot_micro_tokens=args.micro_tokens)
    vocab = choose_vocab(buffer.token_counts(model.config.vocab_size), cfg.draft_vocab, model.config.eos_token_id)
    trainer = DrafterTrainer(EagleDrafter(model.config, vocab).bind(model), cfg, buffer=buffer)  # a run's draft vocabulary
    spot = SpotTrainer(trainer, cfg)
    rng = random.Random(0)
    waits = []
    try:
        spot.begin_step(1, last_step_s=1e9)
        for _ in range(args.pauses):  # pause at a random point of a step
            spot.resume()
            time.sleep(rng.uniform(0.05, 1.0))
            t = time.perf_counter()
            if not spot.pause(wait=True, timeout=60):
                raise SystemExit("a pause was not acknowledged within 60 s")
            waits.append(time.perf_counter() - t)
        print(f"pause acknowledged after (s): median {statistics.median(waits):.3f}, max {max(waits):.3f} "
              f"({len(waits)} pauses, micro-batches of {args.micro_tokens} tokens, {trainer.steps} steps taken)")
        cfg.spot_share = 0.5
        spot.begin_step(2, last_step_s=2 * args.share_s)
        spot.resume()
        while spot.running:
            time.sleep(0.01)
        print(f"share: allowed {spot.allowed_s:.2f}s, used {spot.used_s:.2f}s in {spot.steps_this_rl_step} steps "
              f"(last step {spot.last_step_s:.2f}s)")
    finally:
        spot.close()


if __name__ == "__main__":
    main()
