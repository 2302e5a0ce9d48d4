"""Attention read in place from the paged KV cache, by a C kernel of ours (csrc/paged_attention.c).

The library route of a decode pass gathers every sequence's blocks into a dense [B, kv_heads, keys, D] copy padded to
the pass's longest sequence, then runs PyTorch's CPU flash kernel on the copy; the kernel here reads each sequence's
blocks once through the block table. Where the KV cache is as large as the weights (long responses: the tail) that
copy is most of a decode step's memory traffic (benchmarks/RESULTS.md, issue 47's section).

The kernel is built once per machine with the C compiler (`cc`, or $CC; a few seconds) into a cache folder
($TAILRL_KERNEL_CACHE, default ~/.cache/tailrl/kernels) and loaded with ctypes: no torch headers, no build step at
install. Where it cannot be built (no compiler) or TAILRL_PAGED_KERNEL=0, `available()` is False and the engine keeps
the gather route (and the batch-invariant passes model/chunked.py); the reason is logged once at INFO. It serves the
engine's plain decode and verify passes (up to MAX_Q query rows a sequence, CPU, fp32 or bf16; longer plain passes,
deeper drafts or a prefill continuing a cached prefix, keep the gather route, whose matrix-product kernel wins
there) and every attention of the batch-invariant passes on a CPU: decode, verify and prefill, causal rows given
by each sequence's (cache_len, q_len) with no mask, in items of up to 16 query tokens of one sequence.

A row's output depends only on its query and the keys and values its mask row lets it see, in a fixed order of
operations (csrc/paged_attention.c): it has the same bits whatever else shares the pass, which is what the
batch-invariant passes need (engine/invariant.py; the start-up probe checks it on the loaded build)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
# query rows a sequence up to which the kernel beats gather + grouped SDPA (benchmarks/decode_attention.py, Zen 3,
# fp32, 1 thread, 4-32 sequences over 256-1,024 keys, with each key's rows looked up once: 0.25-0.30x at 1 row,
# 0.49-0.73x at 5, 0.39-1.14x at 9 (0.83x against the idle gather's 28.6 ms at 32 x 1,024), 0.98-1.03x at 17): a verify
# pass of draft budgets up to 8; deeper ones gather
MAX_Q = 9
ITEM_TOKENS = 16  # query tokens of one sequence a kernel item takes at most (csrc QBLOCK): each item reads its keys once
_LIB: list = []  # [the loaded library or None], once per process
_WHY: list[str] = []


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> ctypes.CDLL:
    """Compiles the kernel for this CPU (-march=native) into the cache, keyed by the source, flags, compiler and
    CPU flags, unless it is there; returns the loaded library. Raises RuntimeError naming what failed."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or $CC) to build it")
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(src + " ".join(FLAGS + [cc, version, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TAILRL_KERNEL_CACHE") or Path.home() / ".cache" / "tailrl" / "kernels")
    lib = cache / f"paged_attention-{key}.so"
    if not lib.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then renamed: racing processes are safe
            out = Path(tmp) / lib.name
            run = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"{cc} failed: {run.stderr.strip()[-300:]}")
            os.replace(out, lib)
    dll = ctypes.CDLL(str(lib))
    f = dll.tailrl_paged_attention
    f.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 10 + [ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return dll


def available() -> bool:
    """Whether the kernel is built and loaded (the first call builds it)."""
    if not _LIB:
        if os.environ.get("TAILRL_PAGED_KERNEL", "1") == "0":
            _LIB.append(None), _WHY.append("TAILRL_PAGED_KERNEL=0")
        else:
            try:
                _LIB.append(_build())
            except (RuntimeError, OSError) as e:
                _LIB.append(None), _WHY.append(str(e))
        if _LIB[0] is None:
            log.info("paged decode attention kernel off (%s): decode passes gather the KV cache", _WHY[0])
    return _LIB[0] is not None


def supports(q: torch.Tensor, k_pool: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: CPU, fp32 or bf16, head_dim a multiple of 8 up to 256."""
    D = q.shape[-1]
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k_pool.dtype == q.dtype
            and D % 8 == 0 and D <= 256 and available())


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    slots: torch.Tensor, mask: torch.Tensor | None, lens: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Q, heads, D]; k_pool, v_pool [kv_heads, num_blocks, block, D]; table [rows, width] (int64 block ids of
    each cache row); slots [B] (int64 cache row of each sequence); mask [B, Q, keys] bool (True: the row sees the
    key) or None; lens [B, 2] int64 (cache_len, q_len) or None. Without lens every row is real and sees what its mask
    row says (at least one key). With lens, sequence b reads keys < cache_len + q_len, its rows from q_len on are
    padding (zeros out), and without a mask its row i sees keys 0 .. cache_len + i (causal). Returns
    softmax(q k^T / sqrt(D)) v as [B, Q, heads, D]."""
    if not available():
        raise RuntimeError(f"paged_attention: the kernel is not built here ({_WHY[0]})")
    if q.dtype not in (torch.float32, torch.bfloat16) or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"paged_attention: fp32 or bf16 queries and pools of their dtype, not {q.dtype}/{k_pool.dtype}")
    B, Q, H, D = q.shape
    kvh, nblk, block, _ = k_pool.shape
    q, table, slots = q.contiguous(), table.contiguous(), slots.contiguous()
    if mask is None and lens is None:
        raise ValueError("paged_attention: a mask, or lens for causal rows")
    if table.dtype != torch.int64 or slots.dtype != torch.int64 or (mask is not None and mask.dtype != torch.bool):
        raise TypeError("paged_attention: table and slots are int64, mask is bool")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and v_pool.shape == k_pool.shape):
        raise ValueError("paged_attention: k_pool and v_pool are contiguous and of one shape")
    if lens is not None:
        lens = lens.to(torch.int64).contiguous()
        K = int((lens[:, 0] + lens[:, 1]).max()) if mask is None else mask.shape[2]
        if lens.shape != (B, 2) or (mask is None and int(lens[:, 1].max()) > Q):
            raise ValueError(f"paged_attention: lens {tuple(lens.shape)} do not fit q {tuple(q.shape)}")
    else:
        K = mask.shape[2]
    if mask is not None:
        mask = mask.contiguous()
        if mask.shape[:2] != (B, Q):
            raise ValueError(f"paged_attention: mask {tuple(mask.shape)} does not fit q {tuple(q.shape)}")
    if slots.shape != (B,) or K > table.shape[1] * block:
        raise ValueError(f"paged_attention: {K} keys and slots {tuple(slots.shape)} do not fit q {tuple(q.shape)} "
                         f"and a table of {table.shape[1]} blocks of {block}")
    out = torch.empty_like(q)
    rc = _LIB[0].tailrl_paged_attention(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), slots.data_ptr(),
        None if mask is None else mask.data_ptr(), None if lens is None else lens.data_ptr(), out.data_ptr(),
        B, Q, H, kvh, D, nblk, block, table.shape[1], K, ITEM_TOKENS, int(q.dtype == torch.bfloat16),
        torch.get_num_threads())
    if rc:
        raise RuntimeError(f"paged_attention kernel failed (code {rc}: 1 bad shape, 2 out of memory)")
    return out
