import os

import pytest
import torch

# OMP_NUM_THREADS, where set, wins: two suites side by side on 2 cores must not spin each other's OpenMP barriers
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster of 2 CPUs for a module's tests (`pytestmark = pytest.mark.usefixtures("local_ray")`)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture
def chunked_route(monkeypatch):
    """The batch-invariant passes' attention over fixed key chunks (model/chunked.py), as where our C kernel cannot be
    built (on a CPU it otherwise reads the cache in place, model/paged_attention.py)."""
    from tailrl.model import paged_attention

    monkeypatch.setattr(paged_attention, "_LIB", [None])
    monkeypatch.setattr(paged_attention, "_WHY", ["off for the test"])


@pytest.fixture(scope="session")
def smollm():
    from tailrl.model import load_model

    return load_model("smollm2-135m", device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm():
    from transformers import AutoModelForCausalLM

    from tailrl.model import resolve_model_path

    folder, fname = os.path.split(resolve_model_path("smollm2-135m"))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32).eval()


TINY = {
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=24),
    "llama": dict(model_type="llama", tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


TINY_EXTRA = {"tinychat": dict(model_type="llama", tie_word_embeddings=True)}


def make_tiny_checkpoint(folder, kind: str, seed: int = 0, vocab: int = 96):
    """A random tiny HF checkpoint saved by transformers itself (so names and layout are HF's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY[kind] if kind in TINY else TINY_EXTRA[kind])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases and norms so that every parameter matters to the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


def tiny_model(tmp_path_factory, kind: str = "llama", seed: int = 0, dtype=None):
    """The tiny model family every engine, speculation and update test runs: a random tiny HF checkpoint
    (`make_tiny_checkpoint`: 3 layers, 64 wide, 96 words) of `kind`, loaded by tailrl on the CPU."""
    from tailrl.model import load_model

    folder = tmp_path_factory.mktemp(f"tiny_{kind}_{seed}")
    make_tiny_checkpoint(folder, kind, seed=seed)
    return load_model(str(folder), device="cpu", dtype=dtype)[0]


@pytest.fixture(scope="session", params=list(TINY))
def tiny_ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    hf = make_tiny_checkpoint(folder, request.param)
    return request.param, str(folder), hf


TINY_WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>", "a", "b", "c", "d", "e",
              "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "+", "=", "####", "?"]
# the tiny chat model of the tool tests: its words and the tags the calls and results use
TOOL_WORDS = TINY_WORDS + ["<calc>", "</calc>", "<lookup>", "</lookup>", "<|system|>", "<result>", "</result>"]


def make_tiny_chat_model(folder, seed: int = 0, words=TINY_WORDS):
    """A tiny Llama with a 24-word tokenizer (or `words`, with the first five special ones and '?' among them) and a
    chat template: cheap enough to train in a test."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<eos>",
                                   unk_token="?")
    fast.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                          "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
    make_tiny_checkpoint(folder, "tinychat", seed=seed, vocab=len(words))
    fast.save_pretrained(folder)
    return folder


def peaked_tiny_model(folder, vocab: int, scale: float, dtype=None):
    """A tiny random Qwen2 (token ids, no tokenizer) whose LM head is scaled by `scale`: peaked,
    context-dependent next-token distributions, so a chi-square sees a wrong one with few draws."""
    from tailrl.model import load_model

    hf = make_tiny_checkpoint(folder, "qwen2", seed=4, vocab=vocab)
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)
    hf.save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype=dtype)[0]


@pytest.fixture(scope="module")
def tiny_peaked(tmp_path_factory):
    """A tiny random Qwen2 with a 4-token vocabulary and peaked, context-dependent distributions."""
    return peaked_tiny_model(tmp_path_factory.mktemp("tiny_v4"), vocab=4, scale=4.0)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A tiny chat model (24-word tokenizer) in a folder, for training tests."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tinychat")))


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    from tests.rl_helpers import write_task

    return write_task(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """The tiny chat model loaded (fp32), for drafter tests."""
    from tailrl.model import load_model

    return load_model(str(make_tiny_chat_model(tmp_path_factory.mktemp("tinylm"))), device="cpu", dtype=torch.float32)


VLLM_WORDS = ["<pad>", "<s>", "<eos>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(59)]


VLLM_TOOL_WORDS = VLLM_WORDS[:5] + ["<|system|>", "<calc>", "</calc>", "<result>", "</result>", "+", "####"] + [
    str(d) for d in range(10)] + [f"w{i}" for i in range(42)]


def make_tiny_vllm_model(folder, words=VLLM_WORDS, scale: float = 30.0, chat: bool = False) -> str:
    """A tiny Llama vLLM's CPU kernels take (head_dim 64) with a word-level tokenizer of 64 words. chat: a chat template
    (as make_tiny_chat_model's); scale: the LM head's (30: peaked, context-dependent next-token distributions)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<eos>")
    if chat:
        fast.chat_template = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
                              "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}")
    cfg = AutoConfig.for_model("llama", vocab_size=len(words), hidden_size=128, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                               tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(scale)
    hf.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tool_chat_folder(tmp_path_factory):
    """A tiny chat model whose vocabulary has the calculator's tags: its random draws write calls, good and
    malformed (tests of tool rollouts)."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("toolchat"), seed=3, words=TOOL_WORDS))


@pytest.fixture(scope="module")
def tool_chat(tool_chat_folder):
    from tailrl.model import load_model

    return load_model(tool_chat_folder, device="cpu", dtype=torch.float32)
