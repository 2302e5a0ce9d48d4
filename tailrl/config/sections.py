"""Training configuration: the sections, nested dataclasses with each key's doc as its comment, and the checks
across keys (`Config.validate`). load.py reads them from YAML and dotted `key.sub=value` overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cluster.config import ClusterConfig
from ..drafter.config import DrafterConfig
from ..speculative.config import SpecConfig
from .actor import ActorCfg
from .agent import AgentConfig
from .values import ConfigError

PARTIAL_TIS_CAP = 2.0  # algo.tis_cap under rollout.partial when left at 0 (verl's TIS default)


@dataclass
class ModelCfg:
    path: str = "smollm2-135m"  # known name, HF folder or .gguf
    device: str | None = None  # None: cuda if present, else cpu
    # the rollout engine's weights: auto = bf16 on CUDA and on CPUs with AVX-512 BF16 or AMX (unless ONEDNN_MAX_CPU_ISA
    # caps oneDNN below AVX512_CORE_BF16), else fp32. The trainer keeps fp32 master weights and fp32 Adam state
    # whatever this is.
    dtype: str = "auto"
    # where the update's forward/backward runs: auto = a bf16 copy of the weights when the engine runs bf16 (the
    # fastest here, benchmarks/update.py), else fp32; float32 | autocast (bf16 autocast over fp32) | bfloat16
    train_compute: str = "auto"


# no example answer in it: a seed learned to copy an example's '#### 5' for the format reward (issue 13)
SYSTEM_PROMPT = "Solve the problem step by step, then write the final answer as a number on the last line, after ####."


@dataclass
class DataCfg:
    task: str = "arithmetic"  # built-in task generated locally when train_file is empty
    train_file: str = ""  # JSONL or Parquet with a 'prompt' (text or chat messages) and an 'answer'
    eval_file: str = ""  # held-out prompts (empty: the first data.num_eval rows of train_file)
    # the default run: 16 train prompts, 8 per step, so each comes back every 2nd step (as prompts do over the many
    # epochs of a real run, so the history drafter has earlier responses to the same prompt), and 32 held-out eval
    # prompts
    num_train: int = 16
    num_eval: int = 32  # held-out prompts of the built-in task (or taken from train_file without an eval_file)
    # difficulty levels of the built-in task (empty: all; a train_file is used as it is). The default run keeps
    # arithmetic's levels 1-2 (sums and one-step word problems), where SmolLM2-135M is sometimes right: GRPO learns
    # only where some samples succeed
    levels: list[int] = field(default_factory=lambda: [1, 2])
    prompt_key: str = "prompt"  # the prompt column; a dotted path reaches into a nested column
    answer_key: str = "answer"  # the answer column, e.g. reward_model.ground_truth (verl's, picked by itself)
    # the default run's: SmolLM2-135M rarely writes the answer line unprompted
    # (benchmarks/instructions.py, in git at dc02aa5)
    system_prompt: str = SYSTEM_PROMPT
    max_prompt_tokens: int = 256  # longer prompts are skipped with a warning


@dataclass
class RolloutCfg:
    n: int = 8  # samples per prompt (the GRPO group)
    max_tokens: int = 96  # response tokens per sample at most
    temperature: float = 0.7  # SmolLM2-135M writes noise at 1.0 (pass@8 0.00 vs 0.25 at 0.7: benchmarks/RESULTS.md)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off)
    kv_cache_gb: float | None = None  # None: 25% of RAM (CPU, at most 8 GiB) or 60% of free GPU memory
    max_num_seqs: int = 256  # sequences decoded at once at most
    cuda_graphs: bool = True  # decode/verify replayed from CUDA graphs per bucket where the engine runs on CUDA
    batch_invariant: bool | str = "auto"  # SD on/off draw the very same tokens in bf16 too (engine/invariant.py)
    # prompts that begin with the same whole 16-token blocks (a system prompt, few-shot turns) share their K/V: later
    # requests prefill only what differs. auto: where the passes are batch-invariant (the same tokens either way)
    prefix_cache: bool | str = "auto"
    spec: SpecConfig = field(default_factory=lambda: SpecConfig(mode="auto"))
    workers: int = 1  # 1: the in-process engine; N > 1: N Ray rollout workers (see the cluster section)
    worker_threads: int = 1  # CPU threads per rollout worker (a worker takes one GPU where there are GPUs)
    # the engine that samples: tailrl (ours, the CPU engine and bit-exact reference) or vllm (a vllm.LLM from the
    # policy's HF folder; install: docs/vllm.md)
    backend: str = "tailrl"
    # backend=vllm: the speculation inside vLLM: auto (ours, `custom_class` history proposer, if vLLM's SD passes
    # the losslessness audit, else plain decoding with a warning) | tailrl (ours, refused if the audit fails) |
    # ngram | suffix (vLLM's own, refused if the audit fails) | off
    vllm_spec: str = "auto"
    vllm_spec_tokens: int = 8  # backend=vllm: draft tokens per step at most (num_speculative_tokens)
    # partial rollouts (APRIL, arXiv 2509.18521; rollout/partial.py), off-policy: a step launches partial_oversample x
    # the groups it needs, ends its rollout once trainer.prompts_per_step groups are complete, and carries the
    # unfinished responses into the next step, where they continue under the new weights. Every token keeps the
    # logprob and the policy version that drew it; the update weighs it by truncated importance sampling
    # (algo.tis_cap, 2 when left at 0). With agent.tools a trajectory is carried mid-turn or after a call's
    # observation (rollout/tool_partial.py; on Ray workers rollout/remote_partial.py). Our engine only (in process
    # or Ray workers), not backend=vllm
    partial: bool = False
    partial_oversample: float = 2.0  # groups kept in flight per group the step needs (carried ones count)
    # a response whose oldest token would be trained more than this many policy versions late is restarted
    partial_max_staleness: int = 2


@dataclass
class AlgoCfg:
    advantage: str = "grpo"  # grpo (std-normalised) | dr_grpo (mean-centred only)
    clip_low: float = 0.2  # PPO ratio clip below 1 (1 - clip_low)
    clip_high: float = 0.28  # DAPO clip-higher
    # the policy loss: ppo (the clipped token ratio) | gspo (GSPO, arXiv 2507.18071: one length-normalised, clipped
    # ratio per response) | cispo (MiniMax-M1, arXiv 2506.13585: the clipped, detached ratio times the log-likelihood)
    loss: str = "ppo"
    gspo_clip_low: float = 3e-4  # loss=gspo: the sequence ratio's clip below 1 (the paper's 5.1, verl's gspo recipe)
    gspo_clip_high: float = 4e-4  # loss=gspo: its clip above 1 (clip_low/high apply to ppo only)
    # loss=cispo: the weight is capped at 1 + this; no lower bound. 0.2: at ScaleRL's 4 (arXiv 2510.13786) one default
    # run of 3 collapsed at step 4; at 0.2 none did, 0.68 at step 16 against PPO's 0.69 (benchmarks/RESULTS.md 19)
    cispo_clip_high: float = 0.2
    loss_agg: str = "auto"  # auto (gspo's paper: seq-mean-token-mean, else token-mean) | token-mean | seq-mean-token-mean | seq-mean-token-sum
    clip_ratio_c: float = 0.0  # dual-clip PPO (verl's clip_ratio_c, 3 there): loss <= -A * c where A < 0; 0 = off
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_type: str = "k3"  # k1 | k3
    ppo_epochs: int = 1  # passes over each rollout batch
    mini_batch_size: int = 16  # sequences per optimizer step
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation)
    micro_batch_tokens: int = 0  # > 0: micro-batches by packed tokens (prompts once per group, no padding)
    lr: float = 3e-5  # AdamW learning rate (the peak, with a schedule)
    # constant | cosine (per RL step, down to lr * lr_min_ratio at trainer.steps). cosine: at a constant lr the
    # default run peaked and then fell (held-out 0.72 at step 12 -> 0.56 at 16, seed 0) as its entropy collapsed on
    # 16 train prompts seen 8 times each (benchmarks/RESULTS.md, section 19)
    lr_schedule: str = "cosine"
    lr_warmup_steps: int = 0  # RL steps of linear warmup before the schedule
    lr_min_ratio: float = 0.1  # cosine: the last step's rate over lr
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # gradient norm clip
    tis_cap: float = 0.0  # verl's TIS: each token's loss x min(exp(old - rollout logprob), tis_cap), detached; 0 = off
    # leave sequences with advantage exactly 0 out of the update's forward/backward: their gradient is exactly 0, so
    # the update is the same for less work (none is skipped while kl_coef > 0: its term has a gradient on every one)
    skip_zero_advantage: bool = True
    # DAPO's overlong filtering (TRL's mask_truncated_completions): a response cut at rollout.max_tokens leaves the
    # loss (advantage 0, in no normaliser), since its reward judges an answer it never finished
    mask_truncated: bool = False
    # DAPO's dynamic sampling (verl's filter_groups): groups alike in filter_metric leave the batch; rounds of
    # trainer.prompts_per_step more prompts run until that many informative ones are in hand or max_gen_rounds ran
    # (rl/dynamic.py; metrics rollout/gen_rounds, rollout/filtered_groups, rollout/round_limit)
    dynamic_sampling: bool = False
    filter_metric: str = "acc"  # acc (DAPO's, verl's metric=acc: reward.accuracy's verifier) | reward (the total)
    max_gen_rounds: int = 4  # dynamic sampling's rounds per step at most (each costs a rollout)


@dataclass
class RewardCfg:
    # built-ins or module:function. The default is strict accuracy alone: every shaping term tried was gamed by the
    # default run (partial credit for a right number: it dropped the answer line; a format term: it spammed or
    # copied '#### <number>' lines; issue 13, benchmarks/RESULTS.md)
    functions: list[str] = field(default_factory=lambda: ["math"])
    # one per function; empty: 1.0 each, except the built-in `format` shaping term (0.2)
    weights: list[float] = field(default_factory=list)
    timeout_s: float = 10.0  # per function and step: a hanging function costs at most this once a step
    # the strict verifier behind acc/mean: auto (countdown, verl or math_strict if used, else math) | math | math_strict |
    # countdown | verl
    accuracy: str = "auto"
    max_failed_steps: int = 3  # a function failing on every sample this many steps in a row stops the run
    # DAPO's soft overlong punishment (arXiv 2503.14476 eq 13), on training samples: a reward term falling from 0 at
    # rollout.max_tokens minus this many tokens linearly to -overlong_penalty at the cap; 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the overlong term at rollout.max_tokens (DAPO's penalty factor)


@dataclass
class TrainerCfg:
    steps: int = 16  # the default run lifts held-out greedy accuracy in 4-12 minutes on a 2-core CPU
    prompts_per_step: int = 8  # prompts per RL step (each sampled rollout.n times)
    eval_every: int = 4  # steps; 0 = never
    save_every: int = 4  # steps; 0 = only at the end
    seed: int = 0  # rollout seeds, data order and initialisation
    out_dir: str = "runs/default"  # the run folder: metrics, checkpoints, report
    # continue from the last checkpoint in out_dir exactly as the run that never stopped. A larger trainer.steps than
    # the checkpoint's run had follows another cosine schedule (algo.lr_schedule=cosine decays to trainer.steps)
    resume: bool = False
    # resume a checkpoint whose trainer state is a pickle (trainer_state.pt, before issue 36): unpickling runs any code
    # in the file, so only for a folder you trust; the state is then rewritten as JSON + safetensors
    trust_pickled_state: bool = False
    overwrite: bool = False  # replace the run in out_dir (its metrics and checkpoints are deleted)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    save_optimizer_final: bool = True  # the last checkpoint holds the optimizer state too (2/3 of its size)
    max_skipped_steps: int = 3  # this many steps in a row without a finite update stop the run
    report: bool = True  # write report.md and report.png at the end
    # console | jsonl (metrics.jsonl: the report and resume read it) | tensorboard | wandb (WANDB_MODE=offline: no network)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project: str = ""  # W&B project (empty: $WANDB_PROJECT, else tailrl)
    run_name: str = ""  # W&B run name (empty: the run folder's name)
    # trainer processes: 1 = this process; N = N ranks (Ray actors, one GPU each where there are GPUs, else one CPU)
    # in one torch.distributed group, the policy and AdamW sharded with FSDP2 (README, Scaling out)
    world_size: int = 1
    collective_timeout_s: float = 600.0  # a rank that dies or hangs stops the run within this (world_size > 1)
    # world_size > 1 on GPUs: AdamW state and master weights live on the CPU (FSDP2's CPUOffloadPolicy); off by
    # default: it trades GPU memory for host transfers every step, worth it only when the shards do not fit
    offload: bool = False
    activation_checkpointing: bool = False  # world_size > 1: recompute each layer's activations in the backward


@dataclass
class Config:
    model: ModelCfg = field(default_factory=ModelCfg)
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    reward: RewardCfg = field(default_factory=RewardCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)  # the learned drafter (off by default)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # rollout.workers > 1: placement, migration, Ray
    actor: ActorCfg = field(default_factory=ActorCfg)  # the policy's trainable parameters (LoRA)
    agent: AgentConfig = field(default_factory=AgentConfig)  # multi-turn tool rollouts (off: no tools)

    def validate(self) -> None:
        a = self.algo
        checks = [
            (a.mini_batch_size >= 1 and a.micro_batch_size >= 1, "algo.mini_batch_size", ">= 1 (and micro_batch_size too)"),
            (a.ppo_epochs >= 1, "algo.ppo_epochs", ">= 1"),
            (a.micro_batch_tokens >= 0, "algo.micro_batch_tokens", ">= 0 (0 = micro-batches of micro_batch_size)"),
            (a.lr > 0, "algo.lr", "> 0"),
            (0 <= a.clip_low < 1 and a.clip_high >= 0, "algo.clip_low", "in [0, 1) with clip_high >= 0"),
            (0 <= a.gspo_clip_low < 1 and 0 <= a.gspo_clip_high < math.inf, "algo.gspo_clip_low",
             "in [0, 1) with gspo_clip_high >= 0 and finite"),
            (0 <= a.cispo_clip_high < math.inf, "algo.cispo_clip_high", ">= 0 and finite"),
            (0 <= self.reward.overlong_buffer < self.rollout.max_tokens, "reward.overlong_buffer",
             f">= 0 (0 = off) and below rollout.max_tokens ({self.rollout.max_tokens})"),
            (0 <= self.reward.overlong_penalty < math.inf, "reward.overlong_penalty", ">= 0 and finite"),
            (self.rollout.n >= 2, "rollout.n", ">= 2 (group-relative advantages need a group)"),
            (self.rollout.temperature > 0, "rollout.temperature", "> 0 for training (the policy-gradient loss needs the "
             "sampling distribution; 0 is greedy)"),
            (math.isfinite(self.rollout.temperature), "rollout.temperature", "finite"),
            (all(math.isfinite(w) for w in self.reward.weights), "reward.weights", "finite numbers"),
            (not self.reward.weights or len(self.reward.weights) == len(self.reward.functions), "reward.weights",
             f"one per reward function ({len(self.reward.functions)}: {', '.join(self.reward.functions)}) or empty"),
            (bool(self.reward.functions), "reward.functions", "at least one function"),
            (self.reward.timeout_s > 0 and self.reward.max_failed_steps >= 1, "reward.timeout_s",
             "> 0 (and reward.max_failed_steps >= 1)"),
            (math.isfinite(a.lr) and math.isfinite(a.grad_clip) and a.grad_clip > 0, "algo.grad_clip",
             "finite and > 0 (and algo.lr finite)"),
            (self.data.num_eval >= 1 or not self.trainer.eval_every, "data.num_eval", f">= 1 while trainer.eval_every="
             f"{self.trainer.eval_every} (set trainer.eval_every=0 to train without evaluation)"),
            (self.data.num_eval >= 0 and self.data.max_prompt_tokens >= 1, "data.num_eval", ">= 0"),
            (self.rollout.max_tokens >= 1, "rollout.max_tokens", ">= 1"),
            (self.rollout.workers >= 1 and self.rollout.worker_threads >= 1, "rollout.workers",
             ">= 1 (and rollout.worker_threads >= 1)"),
            (self.trainer.keep_checkpoints >= 1, "trainer.keep_checkpoints", ">= 1"),
            (self.trainer.world_size >= 1 and self.trainer.collective_timeout_s > 0, "trainer.world_size",
             ">= 1 (and trainer.collective_timeout_s > 0)"),
            (self.trainer.max_skipped_steps >= 1, "trainer.max_skipped_steps", ">= 1"),
            (not (self.trainer.resume and self.trainer.overwrite), "trainer.resume",
             "false when trainer.overwrite=true (continue the run, or replace it: not both)"),
            (self.trainer.steps >= 1 and self.trainer.prompts_per_step >= 1, "trainer.steps", ">= 1 (and prompts_per_step)"),
            (a.tis_cap >= 0 and math.isfinite(a.tis_cap), "algo.tis_cap", ">= 0 and finite (0 = off)"),
            (a.max_gen_rounds >= 1, "algo.max_gen_rounds", ">= 1"),
            (a.clip_ratio_c == 0 or (1 < a.clip_ratio_c < math.inf and a.loss == "ppo"), "algo.clip_ratio_c",
             "0 (off), or finite and > 1 with algo.loss=ppo (the dual clip is PPO's)"),
            (a.lr_warmup_steps >= 0 and 0 <= a.lr_min_ratio <= 1, "algo.lr_warmup_steps", ">= 0 (and lr_min_ratio in [0, 1])"),
            (self.rollout.batch_invariant in (True, False, "auto"), "rollout.batch_invariant", "true, false or auto"),
            (self.rollout.prefix_cache in (True, False, "auto"), "rollout.prefix_cache", "true, false or auto"),
            (self.rollout.vllm_spec_tokens >= 1, "rollout.vllm_spec_tokens", ">= 1"),
            (1 <= self.rollout.partial_oversample < math.inf, "rollout.partial_oversample", ">= 1 and finite"),
            (self.rollout.partial_max_staleness >= 0, "rollout.partial_max_staleness", ">= 0 (0: every carried response restarts)"),
            (not (self.rollout.partial and self.rollout.backend == "vllm"), "rollout.partial",
             "false with rollout.backend=vllm (vLLM's offline engine cannot hand back a running sequence to continue "
             "under new weights, nor a tool trajectory's turn; partial rollouts run on our engine, in process or on "
             "Ray workers, with agent.tools or not)"),
        ]
        problems = [f"bad value for {key}: must be {what}" for ok, key, what in checks if not ok]
        if why := next((p for p in problems if p), None):
            raise ConfigError(why)
        from ..engine import SamplingParams
        try:
            SamplingParams(n=self.rollout.n, max_tokens=self.rollout.max_tokens, temperature=self.rollout.temperature,
                           top_p=self.rollout.top_p, top_k=self.rollout.top_k)
        except ValueError as e:
            raise ConfigError(f"bad rollout setting: {e}") from e
