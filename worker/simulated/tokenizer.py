"""The demo checkpoints' tokenizer: byte-level BPE trained in-process on a seeded synthetic
corpus, with bos/eos/pad and a ChatML chat template. Nothing is downloaded, and the same
vocabulary size gives the same tokenizer on any machine with the same package versions."""

from __future__ import annotations

import functools
import itertools
import random

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

# ChatML, as Qwen and many fine-tunes use it, with Qwen2.5's tool format (so the demo model's
# tool parser is "hermes"): tools listed as JSON in a system block, an assistant's calls as
# <tool_call> blocks, tool results as <tool_response> blocks in a user turn. Content may be a
# string, an OpenAI-style list of parts (only text parts are rendered) or None. Unlike Qwen's,
# no default system message: without tools a conversation renders as plain ChatML.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system_first = messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_first -%}{{- render_content(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and system_first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

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


def build_demo_tokenizer(vocab_size: int, model_max_length: int):
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
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"demo tokenizer has {len(tokenizer)} entries, expected {vocab_size}")
    return tokenizer
