"""Deterministic random-weight Hugging Face checkpoints for demos, tests and benchmarks.

A checkpoint written here is a normal Hugging Face model directory
(config.json, safetensors weights, generation_config.json, a byte-level BPE
tokenizer with a ChatML chat template) that `AutoModelForCausalLM` and
`AutoTokenizer` load offline. Nothing is downloaded: the tokenizer is trained
in-process on a synthetic corpus built from a fixed seed, and the weights are
drawn from a seeded generator, so the same arguments give byte-identical files
on any machine with the same package versions.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|begin_of_text|>"
# Qwen's name: transformers rebuilds a qwen2 checkpoint's tokenizer as
# Qwen2Tokenizer, which adds "<|endoftext|>" unless the vocabulary has it.
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so their ids are 0..4 in every demo tokenizer.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# Splits words, single digits, punctuation runs and whitespace (Qwen2's regex).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen and many fine-tunes use it. Content may be a string or an
# OpenAI-style list of parts; only the text parts are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Bumped whenever the files written here change, so a stale cached demo
# checkpoint is never served.
DEMO_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class DemoSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


DEMO_SIZES = {
    "tiny": DemoSize(128, 2, 4, 2, 256, 1000, 2048),
    "small": DemoSize(512, 8, 8, 4, 1408, 32000, 4096),
}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Fixed text mixed into the synthetic corpus so that digits, punctuation, code
# and common English words get merges of their own.
_FIXED_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    "Once upon a time, there was a small model that served many requests.",
    "def main():\n    print('hello world')\n    return 0\n",
    "for i in range(10):\n    total += i * 2\n",
    "The answer is 42. The year is 2024; the price is $3.50 (about 10%).",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 65536",
    "You are a helpful assistant. Please answer the question below.",
    "user: What is the capital of France? assistant: The capital of France is Paris.",
    "https://example.com/index.html?query=value&page=2 #section",
    "{\"name\": \"pagefleet\", \"blocks\": [1, 2, 3], \"ok\": true}",
)


@functools.lru_cache(maxsize=1)
def _synthetic_corpus() -> tuple[str, ...]:
    """English-like sentences from a fixed seed: a lexicon of pseudo-words drawn
    with Zipf frequencies, so BPE finds many distinct merges (enough for 32000)."""
    rng = random.Random(20240601)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s",
              "t", "v", "w", "x", "y", "z", "br", "cr", "dr", "fl", "gr", "pl", "pr", "sh",
              "st", "th", "tr", "ch", "wh", "sp", "sl", "sm", "sn", "str"]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "oo", "ou", "ie", "oa"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "ll",
             "ss", "x", "th", "sh"]
    lexicon: set[str] = set()
    while len(lexicon) < 20000:
        num_syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                            for _ in range(num_syllables)))
    words = sorted(lexicon)
    rng.shuffle(words)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    sentences = []
    for _ in range(30000):
        chosen = rng.choices(words, cum_weights=cum_weights, k=rng.randint(4, 18))
        chosen[0] = chosen[0].capitalize()
        sentences.append(" ".join(chosen) + rng.choice(".....?!,;"))
    # Repeated so the fixed sentences' merges outrank rare pseudo-words.
    return tuple(sentences) + _FIXED_SENTENCES * 50


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Byte-level BPE trained to `vocab_size` entries, as tokenizer.json text.

    Cached per size so tests that write many checkpoints train once. Every byte
    is in the initial alphabet, so any UTF-8 text round-trips."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Qwen2's pipeline (NFC, Qwen's split regex, byte-level without its own
    # regex): AutoTokenizer rebuilds a qwen2 checkpoint's tokenizer with
    # exactly this pipeline from vocab and merges, so using it for every
    # architecture keeps token ids identical whichever class loads the files.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_synthetic_corpus(), trainer)
    # When the corpus runs out of merges, reserved special tokens fill the
    # rest so that tokenizer and model agree on the vocabulary size.
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tokenizer.to_str()


def build_demo_tokenizer(vocab_size: int):
    """A PreTrainedTokenizerFast with bos/eos/pad and the ChatML template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} (bytes + special tokens), got {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=DEMO_SIZES["small"].max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"demo tokenizer has {len(tokenizer)} entries, expected {vocab_size}")
    return tokenizer


def _model_config(arch: str, size: DemoSize, *, vocab_size: int, num_key_value_heads: int,
                  tie_word_embeddings: bool | None, dtype: str, token_ids: dict[str, int]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                    "mistral": MistralConfig}[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        # Qwen3Config defaults head_dim to 128 whatever the hidden size is.
        head_dim=size.hidden_size // size.num_attention_heads,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=token_ids["bos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
    )
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    if arch == "qwen2":
        # Qwen2Config has no head_dim field; its head_dim is hidden // heads anyway.
        del kwargs["head_dim"]
    if arch == "mistral":
        # Mistral v0.2+ checkpoints ship without a sliding window.
        kwargs["sliding_window"] = None
    config = config_class(**kwargs)
    config.dtype = DTYPES[dtype]
    return config


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded init that does not depend on transformers' init order.

    Plain N(0, 0.02) everywhere (as transformers does) makes a random model
    whose residual stream is dominated by a near-uniform average over the
    context, so greedy decoding repeats itself and barely depends on position.
    Instead: q_proj/k_proj std 1/sqrt(hidden) so attention logits are O(1)
    (attention depends on content and rope position, so engine tests catch KV
    cache and position bugs); o_proj/down_proj std 0.02/sqrt(2 * layers) as in
    GPT-2's scaled residual init; embeddings std 0.05 so the current token
    weighs as much as its context. Norm weights are 1, other matrices and
    biases N(0, 0.02). Checked: greedy outputs on random prompts rarely repeat
    a token and change when the first prompt token changes."""
    generator = torch.Generator().manual_seed(seed)
    hidden_size = model.config.hidden_size
    residual_std = 0.02 / (2 * model.config.num_hidden_layers) ** 0.5
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                std = hidden_size ** -0.5
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                std = residual_std
            elif name.endswith("embed_tokens.weight"):
                std = 0.05
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)


def _max_shard_size_for(state_dict: dict[str, torch.Tensor], num_shards: int) -> int:
    """Smallest byte size for which Hugging Face's greedy in-order sharding makes
    exactly `num_shards` files (the shard count only falls as the size grows)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    def count(max_size: int) -> int:
        split = split_torch_state_dict_into_shards(state_dict, max_shard_size=max_size)
        return len(split.filename_to_tensors)

    sizes = [t.numel() * t.element_size() for t in state_dict.values()]
    low, high = max(sizes), sum(sizes)
    while low < high:
        middle = (low + high) // 2
        if count(middle) <= num_shards:
            high = middle
        else:
            low = middle + 1
    if count(low) != num_shards:
        raise ValueError(f"cannot split this checkpoint into exactly {num_shards} shards")
    return low


@contextlib.contextmanager
def _progress_bars_disabled():
    """Silence transformers' per-shard progress bar, restoring the caller's setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def write_demo_checkpoint(
    out_dir: str | os.PathLike,
    *,
    size: str = "tiny",
    arch: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    num_shards: int = 1,
    tie_word_embeddings: bool | None = None,
    vocab_size: int | None = None,
    num_key_value_heads: int | None = None,
) -> Path:
    """Write a random-weight checkpoint to `out_dir` (created if needed) and return its path.

    `tie_word_embeddings=None` keeps the architecture's default (untied for all
    four); `vocab_size` and `num_key_value_heads` override the size preset."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if size not in DEMO_SIZES:
        raise ValueError(f"size must be one of {sorted(DEMO_SIZES)}, got {size!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {list(ARCHITECTURES)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    preset = DEMO_SIZES[size]
    vocab_size = preset.vocab_size if vocab_size is None else vocab_size
    num_kv_heads = preset.num_key_value_heads if num_key_value_heads is None else num_key_value_heads
    if num_kv_heads < 1 or preset.num_attention_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_key_value_heads must divide num_attention_heads={preset.num_attention_heads}, got {num_kv_heads}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer(vocab_size)
    token_ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = _model_config(arch, preset, vocab_size=vocab_size, num_key_value_heads=num_kv_heads,
                           tie_word_embeddings=tie_word_embeddings, dtype=dtype, token_ids=token_ids)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.tie_weights()
    model = model.to(DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=token_ids["bos"],
        # A chat turn ends at <|im_end|>; plain text ends at <|end_of_text|>.
        eos_token_id=[token_ids["eos"], tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=token_ids["pad"],
    )
    save_kwargs = {}
    if num_shards > 1:
        state_dict = {name: t for name, t in model.state_dict().items()
                      if not (config.tie_word_embeddings and name == "lm_head.weight")}
        save_kwargs["max_shard_size"] = _max_shard_size_for(state_dict, num_shards)
    with _progress_bars_disabled():
        model.save_pretrained(out, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(out)

    num_written = len(list(out.glob("*.safetensors")))
    if num_written != num_shards:
        raise RuntimeError(f"wrote {num_written} safetensors files, expected {num_shards}")
    return out


def demo_cache_root() -> Path:
    return Path(os.environ.get("PAGEFLEET_CACHE", Path.home() / ".cache" / "pagefleet")).expanduser()


def default_demo_model_dir() -> Path:
    """The built-in demo checkpoint (tiny Llama, random weights), written on first use.

    Written to a temporary sibling and renamed into place, so concurrent
    processes (several replicas starting at once) never see a half-written
    directory."""
    target = demo_cache_root() / f"demo-tiny-llama-v{DEMO_FORMAT_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write_demo_checkpoint(staging, size="tiny", arch="llama")
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its copy first; theirs is identical.
            if not (target / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target

