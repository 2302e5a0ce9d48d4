import json

import pytest
import torch

from tailrl.engine.kv_cache import KVCache
from tailrl.model import UnsupportedModelError, load_model, make_step, save_pretrained

TOL = 1e-4


def KV(cfg, slots=4, cap=256):
    """A paged cache whose rows each hold `cap` positions."""
    kv = KVCache(cfg, 0, "cpu", torch.float32)
    kv.layout(slots, cap)
    return kv


def prefill_then_decode(model, ids, split, slot=1):
    """Logits of ids run as a prefill of ids[:split] and then a cached pass over the rest."""
    kv = KV(model.config)
    with torch.no_grad():
        a, _ = model(ids[:split], make_step([0], [split], [slot]), kv)
        b, _ = model(ids[split:], make_step([split], [len(ids) - split], [slot]), kv)
    return torch.cat([a, b])


@pytest.mark.slow  # SmolLM2 in transformers
def test_smollm_logits_match_transformers(smollm, hf_smollm):
    model, tok = smollm
    ids = torch.tensor(tok.encode("The quick brown fox jumps over the lazy dog because it"))
    with torch.no_grad():
        ref = hf_smollm(ids[None]).logits[0]
        full, _ = model.forward_full(ids[None])
    # relative to the logits' scale (up to ~20 here): 30 layers of fp32 sums in the orders each CPU's kernels take
    # (AMX, AVX-512, AVX2 block the reductions differently) put the difference at 1e-4 absolute on an AMX Xeon
    tol = TOL * max(1.0, float(ref.abs().max()))
    assert (full[0] - ref).abs().max() < tol
    cached = prefill_then_decode(model, ids, len(ids) - 4)
    assert (cached - ref).abs().max() < tol


@pytest.mark.slow  # SmolLM2 in transformers: loading it is 25 s of the fast tier
def test_smollm_hidden_states_match_transformers(smollm, hf_smollm):
    model, tok = smollm
    ids = torch.tensor(tok.encode("Hidden states for the drafter"))
    with torch.no_grad():
        ref = hf_smollm(ids[None], output_hidden_states=True).hidden_states
        _, hidden = model(ids, make_step([0], [len(ids)], [0]), KV(model.config), hidden_layers=(0, 3, 15, 30))
    for layer in (0, 3, 15, 30):  # the bound scales with the layer's values (layer 3 holds some near 760, where one
        # fp32 ulp is 6e-5): the engine's few-row products run another kernel than transformers' (model/packed.py)
        assert (hidden[layer] - ref[layer][0]).abs().max() < TOL * max(1.0, ref[layer][0].abs().max().item()), layer


def test_tiny_checkpoints_match_transformers(tiny_ckpt):
    kind, folder, hf = tiny_ckpt
    model, tok = load_model(folder, device="cpu")
    assert tok is None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        full, _ = model.forward_full(ids[None])
    assert (full[0] - ref).abs().max() < TOL
    for split in (1, 17, 39):
        assert (prefill_then_decode(model, ids, split) - ref).abs().max() < TOL, (kind, split)


def test_batched_prefill_of_unequal_lengths_matches_single(tiny_ckpt):
    _, folder, hf = tiny_ckpt
    model, _ = load_model(folder, device="cpu")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (7, 19, 3)]
    kv = KV(model.config)
    with torch.no_grad():
        logits, _ = model(torch.cat(seqs), make_step([0, 0, 0], [7, 19, 3], [2, 0, 3]), kv)
        out = logits.split([7, 19, 3])
        for s, o in zip(seqs, out):
            assert (o - hf(s[None]).logits[0]).abs().max() < TOL


def test_tree_mask_equals_each_path(smollm):
    """A draft tree verified in one pass gives every node the logits of its root-to-node path."""
    model, tok = smollm
    prefix = torch.tensor(tok.encode("Numbers: one, two, three,"))
    # tree over new tokens: 0 -> 1 -> 2 ; 0 -> 3 ; 3 -> 4 ; 1 -> 5
    tokens = torch.tensor(tok.encode(" four five six seven eight nine")[:6])
    parent = [-1, 0, 1, 0, 3, 1]
    depth = [0, 1, 2, 1, 2, 2]
    n = len(parent)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    P = len(prefix)
    kv = KV(model.config)
    with torch.no_grad():
        model(prefix, make_step([0], [P], [0]), kv)
        step = make_step([P], [n], [0], positions=torch.tensor(depth) + P, tree_masks=[mask])
        tree_logits, _ = model(tokens, step, kv)
        for i in range(n):
            path = []
            j = i
            while j >= 0:
                path.append(j)
                j = parent[j]
            path = path[::-1]
            ref, _ = model.forward_full(torch.cat([prefix, tokens[path]])[None])
            assert (tree_logits[i] - ref[0, -1]).abs().max() < TOL, i


def test_save_pretrained_roundtrips_through_transformers(smollm, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = smollm
    save_pretrained(model, tmp_path, tok)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    again, tok2 = load_model(str(tmp_path), device="cpu")
    ids = torch.tensor(tok2.encode("Round trip"))[None]
    with torch.no_grad():
        ours, _ = model.forward_full(ids)
        assert (hf(ids).logits - ours).abs().max() < TOL
        assert (again.forward_full(ids)[0] - ours).abs().max() == 0


def test_sharded_checkpoint_loads(tmp_path):
    from tailrl.model.tiny import make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "a", "qwen2")
    hf.save_pretrained(tmp_path / "b", max_shard_size="100KB")
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    a, _ = load_model(str(tmp_path / "a"), device="cpu")
    b, _ = load_model(str(tmp_path / "b"), device="cpu")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(a.forward_full(ids)[0], b.forward_full(ids)[0])


def test_unknown_model_path_names_it():
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        load_model("no/such/model")


def test_unsupported_architecture_names_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path))


def test_mismatched_weights_name_the_missing_keys(tmp_path):
    from tailrl.model.tiny import make_tiny_checkpoint
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(tmp_path, "qwen2")
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


def test_grouped_attention_gives_the_fused_kernels_bits():
    """Stacking the query heads that share a K/V head into one block of rows is a layout change only: in bf16,
    with 4 or more query rows as the batch-invariant decode runs it, the output equals SDPA's own GQA bit for bit."""
    import torch.nn.functional as F

    from tailrl.model.llama import _grouped_attention

    g = torch.Generator().manual_seed(0)
    for B, Q in [(1, 4), (8, 4), (8, 9), (33, 5)]:
        q = torch.randn(B, 9, Q, 64, generator=g).bfloat16()
        k, v = (torch.randn(B, 3, 96, 64, generator=g).bfloat16() for _ in range(2))
        c = torch.randint(10, 80, (B, 1, 1), generator=g)
        j, i = torch.arange(96).view(1, 1, 96), torch.arange(Q).view(1, Q, 1)
        mask = ((j < c) | ((j >= c) & (j - c <= i))).unsqueeze(1)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(_grouped_attention(q, k, v, mask), ref)


def test_packed_linear_matches_and_follows_weight_updates():
    """The engine's few-row products run on a packed copy of the weight (model/packed.py): the product within the
    fp32 bound of a 64-term dot product, and never a stale weight after an in-place update or a new tensor."""
    from tailrl.model.packed import packed_linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(5, 64)

    def check():
        with torch.inference_mode():
            got, want = packed_linear(layer, x), layer(x)
        bound = 64 * 2**-23 * (x.abs() @ layer.weight.abs().t() + layer.bias.abs()).max()
        assert (got - want).abs().max() <= bound

    check()
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # a weight sync copies in place
    check()
    layer.weight = torch.nn.Parameter(torch.randn(32, 64))  # a new tensor
    check()


def test_an_engine_decodes_with_the_weights_a_fused_optimizer_step_left(tmp_path_factory):
    """torch's fused AdamW updates parameters in place without moving their version counters, so a pack keyed by the
    version alone went stale: an engine sharing the trainer's fp32 policy decoded from its first weights (a resumed
    run then diverged from one never stopped). A new batch of requests repacks (model/packed.py, Engine.add_requests):
    the engine's greedy tokens after the step equal a fresh engine's on a copy of the stepped model."""
    import copy

    from tailrl.engine import Engine, EngineConfig, SamplingParams
    from tests.helpers import tiny_model

    model = tiny_model(tmp_path_factory, dtype=torch.float32)
    prompts, params = [[1, 5, 9, 2], [7, 3]], SamplingParams(temperature=0, max_tokens=12)
    eng = Engine(model, None, EngineConfig(kv_cache_gb=0.05))
    before = [c.token_ids for c in eng.generate(prompts, params)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    fresh = Engine(copy.deepcopy(model), None, EngineConfig(kv_cache_gb=0.05))
    want = [c.token_ids for c in fresh.generate(prompts, params)]
    assert want != before, "the step must change the greedy tokens for this test to mean anything"
    assert [c.token_ids for c in eng.generate(prompts, params)] == want
