"""Rollout speed of SD auto against SD off on the very same policy and history: both arms resume a run's checkpoint
(weights, history index, data position) and time the next step's rollout, interleaved, several times.

Both arms sample the same prompts with the same seeds and weights; with batch-invariant decoding (bf16 on a CPU,
engine/invariant.py) they emit the very same tokens, and the script counts the responses that agree. Give it an
SD-auto run: an SD-off run's checkpoint holds no history index, so its auto arm drafts from siblings alone (the
regime of a run's first epoch). Prints the selector's choices and the tokens/s per batch-size bucket too.

    .venv/bin/python benchmarks/replay.py RUN_DIR [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from tailrl.config import load_config


def trainer_for(run: Path, mode: str):
    from tailrl.rl.trainer import Trainer

    # the run's config.json is YAML too; its own folder, so resume() reads its checkpoints
    return Trainer(load_config(str(run / "config.json"), [f"rollout.spec.mode={mode}", "trainer.resume=true", "trainer.overwrite=false"]))


def timed_rollout(trainer) -> dict:
    trainer.resume()  # the checkpoint's weights, history index and data position, every time (an SD-off run's
    # checkpoint has no history index: the auto arm then drafts from siblings alone, as in a run's first epoch)
    examples = [trainer.train_set[i] for i in trainer.loader.next(trainer.cfg.trainer.prompts_per_step)]
    t = time.perf_counter()
    comps = trainer.rollout(examples, trainer.step)
    s = time.perf_counter() - t
    st = trainer.engine.last_stats
    return {"s": s, "tokens": sum(len(c.token_ids) for c in comps), "accept": st.mean_accept_length,
            "max_len": max(len(c.token_ids) for c in comps), "same": [c.token_ids for c in comps],
            "choices": st.choices, "by_bucket": st.by_bucket,
            "parts": {"prefill": st.prefill_s, "draft": st.draft_s, "forward": st.forward_s, "verify": st.verify_s,
                      "decode steps": st.decode_steps}}


def bucket_range(b: int) -> str:
    lo, hi = (1 << (b - 1)) + 1 if b else 1, 1 << b
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.getLogger("tailrl").setLevel(logging.ERROR)
    arms = {m: trainer_for(args.run, m) for m in ("off", "auto")}
    for tr in arms.values():  # warm-up: the selector measures its cost table and acceptance (not checkpointed)
        timed_rollout(tr)
    res = {m: [] for m in arms}
    for _ in range(args.repeats):
        for m, tr in arms.items():
            res[m].append(timed_rollout(tr))
    step = arms["off"].step
    print(f"\n{args.run} at step {step}: the next step's rollout ({arms['off'].cfg.trainer.prompts_per_step} prompts x "
          f"{arms['off'].cfg.rollout.n}), {args.repeats} repeats per arm, interleaved\n")
    print("| arm | rollout s (each) | mean s | tokens (mean) | longest | tokens/s | accept len |")
    print("|---|---|---|---|---|---|---|")
    mean = {}
    for m, rs in res.items():
        mean[m] = sum(r["s"] for r in rs) / len(rs)
        tok = sum(r["tokens"] for r in rs) / len(rs)
        each = ", ".join(f"{r['s']:.1f}" for r in rs)
        print(f"| SD {m} | {each} | {mean[m]:.1f} | {tok:.0f} | "
              f"{max(r['max_len'] for r in rs)} | {tok / mean[m]:.0f} | {sum(r['accept'] for r in rs) / len(rs):.2f} |")
    print(f"\nrollout speedup (mean time off / auto): {mean['off'] / mean['auto']:.2f}x")
    same = sum(a == b for r_off, r_auto in zip(res["off"], res["auto"]) for a, b in zip(r_off["same"], r_auto["same"]))
    print(f"responses SD auto emitted exactly as SD off: {same} of {sum(len(r['same']) for r in res['off'])}")
    print("\nwhere the rollout's time goes (mean over repeats; seconds, and decode steps)")
    print("| arm | prefill | draft | forward | sample/accept | decode steps |")
    print("|---|---|---|---|---|---|")
    for m, rs in res.items():
        p = {k: sum(r["parts"][k] for r in rs) / len(rs) for k in rs[0]["parts"]}
        print(f"| SD {m} | {p['prefill']:.2f} | {p['draft']:.2f} | {p['forward']:.2f} | {p['verify']:.2f} | "
              f"{p['decode steps']:.0f} |")
    print("\nper batch-size bucket (last repeat): decode steps per arm the selector chose; tokens/s off -> auto")
    last = {m: rs[-1] for m, rs in res.items()}
    for b in sorted(last["auto"]["by_bucket"]):
        rate = {m: (lambda c: c[0] / c[1] if c and c[1] else 0.0)(last[m]["by_bucket"].get(b)) for m in last}
        print(f"  B {bucket_range(b)}: {last['auto']['choices'].get(b, {})}; {rate['off']:.0f} -> {rate['auto']:.0f}")
    for tr in arms.values():
        tr.close()


if __name__ == "__main__":
    main()
