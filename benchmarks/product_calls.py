"""What the batch-invariant passes' product calls cost, and which call sizes keep a row's bits (issue 75).

The invariant passes run every product on whole 16-row tiles, in calls no larger than the start-up probe found
every tile to keep the bits of its own call (engine/probe.py `_call_rows`; model/chunked.py `in_calls`). On an Intel
CPU with AMX that limit is 32 rows for every SmolLM2 shape, so a verify pass of 128 rows runs each product in 4
calls. This prints, per weight shape and rows a pass: one packed call of all rows against calls of 32 and of 16
(milliseconds, best of three rounds of `--repeats`), and whether every 16-row tile of the one call equals that tile's own call
on cancelling data (engine/probe_data.py), i.e. which call sizes the probe could allow.

    .venv/bin/python benchmarks/product_calls.py [--threads 2] [--dtype bfloat16] [--rows 16 32 48 64 96 128 256]

Run it alone (other processes stopped): the figures are tens of microseconds."""

from __future__ import annotations

import argparse
import time

import torch

from tailrl.engine.probe_data import cancelling_product
from tailrl.model.packed import linear_packed, pack_weight

SHAPES = {"q/o 576->576": (576, 576), "k/v 576->192": (192, 576), "gate/up 576->1536": (1536, 576),
          "down 1536->576": (576, 1536), "LM head 576->49152": (49152, 576)}  # SmolLM2-135M's (out, in)


def best_ms(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            f()
        times.append((time.perf_counter() - t) / repeats * 1e3)
    return min(times)


def in_calls(x: torch.Tensor, packed: torch.Tensor, rows: int) -> torch.Tensor:
    """As model/chunked.py `in_calls` runs them: one call where the rows fit, else calls of `rows`, concatenated."""
    if x.shape[0] <= rows:
        return linear_packed(x, packed, None)
    return torch.cat([linear_packed(x[i : i + rows], packed, None) for i in range(0, x.shape[0], rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128, 256])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {a.threads} threads, {a.dtype}; ms a product, best of 3 x {a.repeats}\n")
    print("| weight | rows | one call | calls of 32 | calls of 16 | 32s / one | tiles keep their bits in one call |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        x, w = cancelling_product((torch.randn(n, k, generator=g) * 0.05).to(dtype), max(a.rows), g)
        packed = pack_weight(w)
        if packed is None:
            print(f"| {name} | - | oneDNN cannot pack {a.dtype} on this CPU | | | | |")
            continue
        for m in a.rows:
            xm = x[:m]
            one = best_ms(lambda: linear_packed(xm, packed, None), a.repeats)
            c32 = best_ms(lambda: in_calls(xm, packed, 32), a.repeats) if m % 32 == 0 else float("nan")
            c16 = best_ms(lambda: in_calls(xm, packed, 16), a.repeats)
            keeps = torch.equal(linear_packed(xm, packed, None), in_calls(xm, packed, 16))
            print(f"| {name} | {m} | {one:.3f} | {c32:.3f} | {c16:.3f} | {c32 / one:.2f}x | {'yes' if keeps else 'no'} |")


if __name__ == "__main__":
    main()
