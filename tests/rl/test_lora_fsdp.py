"""LoRA at `trainer.world_size=2` (issue 66): two gloo ranks (Ray actors, one thread each) shard the adapters with
FSDP2 (fsdp.apply_fsdp_lora; the frozen base whole on every rank) and reach the one-process LoRA run's adapters,
hold about half of the adapters' AdamW moments each, stream the merged weights to the engine, write the adapter in
PEFT's format (rank 0) with the adapters' shards and moments in dcp/, and resume from it exactly at 2 ranks and at 1;
a one-process LoRA checkpoint resumes at 2 ranks."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tailrl.config.actor import PROJECTIONS
from tailrl.rl.checkpoint.sharded_io import read_metadata
from tailrl.rl.run import train
from tailrl.model.tiny import make_tiny_chat_model
from tests.rl_helpers import tiny_cfg, write_task

# fp32: each mini-batch holds two GRPO groups, one per rank; the one-process run accumulates the same two groups'
# gradients (one micro-batch each) in fp32, FSDP2's reduce-scatter sums them, so the adapters agree to the rounding
# of a sum of two fp32 tensors taken in the other order, amplified by Adam over 3 steps: bound 1e-6 (measured: 0,
# a + b == b + a in floating point; a rank that lost its gradients, or a gather that missed, moves them by ~1e-2)
ATOL = 1e-6
LORA = ("actor.lora.rank=4", "actor.lora.alpha=8")

pytestmark = [pytest.mark.usefixtures("local_ray"), pytest.mark.slow]  # a local Ray cluster per module (conftest.py)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_fsdp")
    return str(make_tiny_chat_model(d / "chat")), write_task(d / "train.jsonl")


def cfg(setup, out, *extra):
    chat, task = setup
    return tiny_cfg(chat, task, out, "trainer.steps=3", "trainer.keep_checkpoints=3", "algo.mini_batch_size=16",
                    "trainer.collective_timeout_s=60", *LORA, *extra)


def adapter(run, step: int) -> dict:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model" / "adapter_model.safetensors"))


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def assert_close(a: dict, b: dict, atol: float = ATOL) -> None:
    assert a.keys() == b.keys() and a
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"max |difference| {worst:.3g}")
    assert worst <= atol, f"max |difference| {worst:.3g}"


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """fp32 LoRA runs of 3 steps from the same seed at 1 and at 2 ranks (the latter with the merged export)."""
    root = tmp_path_factory.mktemp("runs")
    one = train(cfg(setup, root / "one", "model.dtype=float32"))
    two = train(cfg(setup, root / "two", "model.dtype=float32", "trainer.world_size=2", "actor.lora.merged_export=true"))
    return one, two


def test_two_ranks_train_the_adapters_to_the_one_process_ones(runs):
    one, two = runs
    a, b = rows(one), rows(two)
    assert len(b) == 3  # world_size=2 with LoRA trains (it was refused at config time before)
    # the same rollouts, step 2 and 3 from the merged weights each side sent its engine
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    for s in (1, 3):
        assert_close(adapter(one, s), adapter(two, s))
    w3 = adapter(two, 3)
    assert any(not torch.equal(w3[k], v) for k, v in adapter(two, 1).items() if ".lora_B." in k)  # they moved
    assert any(float(v.abs().max()) > 1e-3 for k, v in w3.items() if ".lora_B." in k)  # B starts at zero


def test_each_rank_holds_half_of_the_adapters_moments(runs, setup):
    from tailrl.model import load_model

    _, two = runs
    n = sum(t.numel() for t in adapter(two, 1).values())
    base = load_model(setup[0], device="cpu", dtype=torch.float32)[0]
    base_bytes = 4 * sum(p.numel() for p in base.parameters())
    adapted = sum(m.weight.numel() for name, m in base.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS)
    for r in rows(two):
        assert 0.45 * 2 * 4 * n <= r["actor/optimizer_bytes_per_rank"] <= 0.55 * 2 * 4 * n  # exp_avg + exp_avg_sq
        # the frozen base whole (fp32 here) + half the fp32 adapters
        assert 0.45 * 4 * n <= r["actor/param_bytes_per_rank"] - base_bytes <= 0.55 * 4 * n
        assert r["sync/bytes"] == 4 * adapted and r["timing_s/sync"] > 0  # the merged adapted layers (fp32 engine)


def test_only_the_adapters_are_trained_and_the_base_stays_bit_for_bit(runs, setup):
    """dcp/ holds the adapters and their moments only (no base tensor has a gradient or a moment), and the merged
    export of the last step is the original base + (alpha/r) B A of the saved adapter, bit for bit: the ranks' base
    weights never moved."""
    from tailrl.model import load_model
    from tailrl.rl.actor.lora import add_adapters, lora_layers, merged_state
    from tailrl.config.actor import LoraCfg
    from tailrl.rl.actor.lora_io import load_adapter_state

    _, two = runs
    ckpt = two / "checkpoints" / "step_000003"
    keys = read_metadata(ckpt / "dcp").state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    optim_keys = [k for k in keys if k.startswith("optim.")]
    assert len(model_keys) == len(adapter(two, 3)) and all(".lora_" in k for k in model_keys)
    assert optim_keys and all(".lora_" in k for k in optim_keys)
    assert {k.rsplit(".", 1)[-1] for k in optim_keys} == {"step", "exp_avg", "exp_avg_sq"}
    merged = {}
    for f in (ckpt / "merged").glob("*.safetensors"):
        merged.update(load_file(str(f)))
    base = load_model(setup[0], device="cpu", dtype=torch.float32)[0]
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    policy = add_adapters(base, LoraCfg(rank=4, alpha=8))
    load_adapter_state(policy, adapter(two, 3))
    want = merged_state(policy, torch.float32)
    assert merged.keys() == original.keys()
    adapted = {n + ".weight" for n in lora_layers(policy)}
    for n, t in merged.items():
        assert torch.equal(t, want[n]), n
        if n not in adapted:  # a tensor without an adapter: the base's own
            assert torch.equal(t, original[n]), n
    assert any(not torch.equal(merged[n], original[n]) for n in adapted)
    assert len(adapted) == 7 * base.config.num_hidden_layers


def test_a_checkpoint_of_two_ranks_loads_with_peft_and_ours(runs, setup):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tailrl.rl.actor.lora_io import load_any

    _, two = runs
    folder = two / "checkpoints" / "step_000003" / "model"
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    hf = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32), str(folder))
    ours, _ = load_any(str(folder), device="cpu", dtype=torch.float32)
    seq = torch.tensor([[1, 5, 9, 12, 7, 3, 20, 14]])
    with torch.no_grad():
        want = hf.eval()(seq).logits
        got, _ = ours.forward_full(seq)
        base = AutoModelForCausalLM.from_pretrained(setup[0], dtype=torch.float32)(seq).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(base, want, atol=1e-4)  # the adapter changes the model


@pytest.mark.parametrize("world", [2, 1])
def test_a_two_rank_checkpoint_resumes_exactly(runs, setup, tmp_path, world):
    _, two = runs
    run = tmp_path / "run"
    shutil.copytree(two, run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002")
    train(cfg(setup, run, "model.dtype=float32", f"trainer.world_size={world}", "trainer.resume=true"))
    # 2 -> 2: the same shards, moments and sums (exact); 2 -> 1: the one-process sum, equal here (see ATOL)
    assert_close(adapter(run, 3), adapter(two, 3), 0.0 if world == 2 else ATOL)
    assert [r["reward/mean"] for r in rows(run)] == [r["reward/mean"] for r in rows(two)]
    assert rows(run)[-1]["actor/grad_norm"] == pytest.approx(rows(two)[-1]["actor/grad_norm"], rel=1e-6)


def test_two_ranks_over_a_bf16_base_with_the_kl_reference(setup, tmp_path):
    """The bf16 compute path (ComputeCast, the fused `_lean_forward` that reads the adapters' weights directly) and
    the KL reference (the base with the adapters off) at 2 ranks: the one-process adapters, to the same bound (the
    same bf16 products per group, their fp32 gradients summed in the other order)."""
    extra = ("model.dtype=bfloat16", "model.train_compute=bfloat16", "algo.kl_coef=0.1", "trainer.steps=2")
    one = train(cfg(setup, tmp_path / "one", *extra))
    two = train(cfg(setup, tmp_path / "two", *extra, "trainer.world_size=2"))
    a, b = rows(one), rows(two)
    assert [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
    assert b[-1]["actor/kl"] > 0 and b[-1]["actor/kl"] == pytest.approx(a[-1]["actor/kl"], rel=1e-4)
    assert_close(adapter(one, 2), adapter(two, 2))
    assert any(float(v.abs().max()) > 1e-3 for k, v in adapter(two, 2).items() if ".lora_B." in k)


def _grad_rank(rank: int, chat: str, folder: str) -> None:
    """One gloo rank of `test_fsdp_gathers_the_adapters_for_the_fused_bf16_forward` (spawned, no Ray)."""
    import copy

    import torch.distributed as dist

    from tailrl.model import load_model
    from tailrl.rl.actor.fsdp import apply_fsdp_lora
    from tailrl.rl.actor.lora import add_adapters, full, lora_layers
    from tailrl.config.actor import LoraCfg

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.manual_seed(0)
    policy = add_adapters(load_model(chat, device="cpu", dtype=torch.bfloat16)[0], LoraCfg(rank=4, alpha=8))
    with torch.no_grad():  # B off zero, so that A's gradients and the adapters' outputs are not zero
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.3)
    one = copy.deepcopy(policy)  # the same model, unsharded: what one process computes
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if ".lora_" not in n}
    apply_fsdp_lora(policy)
    assert all("_lean_forward" in str(m.forward) for m in lora_layers(policy).values())  # the fused path reads .weight
    ids = torch.randint(0, 24, (2, 9), generator=torch.Generator().manual_seed(1))
    w = torch.linspace(-1, 1, 24)

    def loss(model, rows):
        return (model.forward_full(ids[rows])[0].float() * w).sum()

    loss(policy, [rank]).backward()  # each rank its own row; FSDP2 sums the adapters' gradients into shards
    for r in (0, 1):  # one process: the two rows one after the other, gradients accumulated
        loss(one, [r]).backward()
    grads = {n: full(p.grad) for n, p in policy.named_parameters() if p.requires_grad}
    frozen_grads = [n for n, p in policy.named_parameters() if not p.requires_grad and p.grad is not None]
    local = sum(p.to_local().numel() for p in policy.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    moved = {n: full(p) for n, p in policy.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"grads": grads, "want": {n: p.grad for n, p in one.named_parameters() if p.requires_grad},
                    "frozen_grads": frozen_grads, "local": local, "start": {n: p.detach() for n, p in one.named_parameters()},
                    "moved": moved,
                    "base_same": all(torch.equal(p, base[n]) for n, p in policy.named_parameters() if ".lora_" not in n)},
                   f"{folder}/out.pt")
    dist.barrier()  # tear down together: a rank that left while the other still wrote once aborted in gloo (-6)
    dist.destroy_process_group()


def test_fsdp_gathers_the_adapters_for_the_fused_bf16_forward(setup, tmp_path):
    """Over a bf16 base the fused `_lean_forward` reads the adapters' weights directly (not through their modules'
    forward): the decoder layer's FSDP2 hooks must gather them before it and again for the backward. Two ranks, a row
    each, give the adapters' gradients one process gets from both rows, to 1e-6 of their size (the same bf16 products
    row by row, two fp32 gradients summed; measured equal), none to the base; after AdamW the base is as it was."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_grad_rank, args=(r, setup[0], str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = torch.load(tmp_path / "out.pt")
    assert got["grads"].keys() == got["want"].keys() and len(got["grads"]) == 42
    for n, g in got["grads"].items():
        want = got["want"][n]
        assert want.abs().max() > 0, n
        torch.testing.assert_close(g, want, atol=1e-6 * float(want.abs().max()), rtol=0), n
    assert got["frozen_grads"] == []
    assert 0.45 <= got["local"] / sum(g.numel() for g in got["grads"].values()) <= 0.55  # half the adapters here
    assert all(not torch.equal(t, got["start"][n]) for n, t in got["moved"].items())  # every adapter moved
    assert got["base_same"]


def test_a_one_process_lora_checkpoint_resumes_at_two_ranks(runs, setup, tmp_path):
    """The adapter (PEFT's names) and AdamW's state (by position) of a world_size=1 checkpoint, sharded over 2 ranks:
    the next step is the one-process run's (to ATOL)."""
    one, _ = runs
    run = tmp_path / "run"
    shutil.copytree(one, run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002")
    train(cfg(setup, run, "model.dtype=float32", "trainer.world_size=2", "trainer.resume=true"))
    assert_close(adapter(run, 3), adapter(one, 3))
    assert [r["reward/mean"] for r in rows(run)] == [r["reward/mean"] for r in rows(one)]
    assert rows(run)[-1]["actor/grad_norm"] == pytest.approx(rows(one)[-1]["actor/grad_norm"], rel=1e-6)
