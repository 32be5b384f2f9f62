"""The prompts ``pagefleet bench`` sends: random token lengths, tenants that share a prefix,
or a local file (JSONL of ``{"prompt": ..., "output_len": ...}`` or ShareGPT conversations).

Each is a pure function of a tokenizer and a seed.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from pagefleet.cluster.bench.client import BenchRequest

# ShareGPT filtering, as vLLM does it: drop tiny turns and keep within a 2K context.
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
FILE_DEFAULT_OUTPUT_LEN = 256


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """[floor(L(1 - r)), ceil(L(1 + r))], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


class _TokenText:
    """Turns runs of token ids into text that re-tokenizes to the wanted number of tokens."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        special = set(tokenizer.all_special_ids)
        ids = [i for i in range(len(tokenizer)) if i not in special]
        # Only tokens that survive decode and re-encode alone: a lone byte-fallback token
        # decodes to U+FFFD, which re-encodes as three tokens.
        texts = tokenizer.batch_decode([[i] for i in ids])
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.allowed = [i for i, back in zip(ids, encoded) if back == [i]]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, length: int, offset: int | None = None) -> tuple[str, int]:
        """(text, its token count): consecutive allowed ids from a random offset, decoded;
        decoding can merge or split tokens, so the ids are re-encoded and cut until the count holds."""
        start = self.rng.randrange(len(self.allowed)) if offset is None else offset
        ids = [self.allowed[(start + j) % len(self.allowed)] for j in range(length)]
        text = self.tok.decode(ids)
        for attempt in range(50):
            ids = self.encode(text)
            if len(ids) == length:
                break
            ids = ids[:length] + [self.rng.choice(self.allowed) for _ in range(length - len(ids))]
            if attempt >= 2:  # the cut keeps re-merging: try other tokens at the seam
                ids[-2:] = [self.rng.choice(self.allowed) for _ in ids[-2:]]
            text = self.tok.decode(ids)
        return text, len(self.encode(text))


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """Like vLLM's random dataset: lengths uniform on [L(1 - r), L(1 + r)], prompts of random tokens."""
    rng = random.Random(seed)
    words = _TokenText(tokenizer, rng)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    out = []
    for _ in range(num_prompts):
        text, n = words.text(rng.randint(in_lo, in_hi))
        out.append(BenchRequest(text, n, rng.randint(out_lo, out_hi)))
    return out


def shared_prefix_requests(tokenizer, num_tenants: int, questions_per_tenant: int, prefix_len: int,
                           question_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Each tenant has its own random prefix (a system prompt, a document) of ``prefix_len``
    tokens, followed by each of its questions; tenants interleave in a seeded shuffle."""
    if num_tenants < 1 or questions_per_tenant < 1:
        raise ValueError("shared-prefix needs at least one tenant and one question per tenant")
    rng = random.Random(seed)
    words = _TokenText(tokenizer, rng)
    out = []
    for _ in range(num_tenants):
        prefix, _ = words.text(prefix_len)
        for _ in range(questions_per_tenant):
            question, _ = words.text(question_len)
            prompt = f"{prefix}\n{question}"
            out.append(BenchRequest(prompt, len(words.encode(prompt)), output_len))
    rng.shuffle(out)
    return out


def file_requests(path: str | Path, tokenizer, num_prompts: int, output_len: int | None,
                  seed: int) -> list[BenchRequest]:
    """A JSON list or JSONL of records, each ``{"prompt": str, "output_len": int?}`` or a
    ShareGPT conversation (``{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}``:
    the first human turn is the prompt, the reply's length the output length).
    Records are shuffled with the seed; if fewer than ``num_prompts`` are usable they repeat."""
    records = _read_records(Path(path))
    usable = [r for r in (_request(rec, tokenizer, output_len, i, path) for i, rec in enumerate(records))
              if r is not None]
    random.Random(seed).shuffle(usable)
    if not usable:
        raise ValueError(f"{path} has no usable prompt (ShareGPT turns need {SHAREGPT_MIN_LEN}..."
                         f"{SHAREGPT_MAX_PROMPT} prompt tokens and at most {SHAREGPT_MAX_TOTAL} in all)")
    return [usable[i % len(usable)] for i in range(num_prompts)]


def _read_records(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON: {exc.msg}") from None
    if not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: every record must be a JSON object")
    return records


def _request(rec: dict, tokenizer, output_len: int | None, index: int, path) -> BenchRequest | None:
    if "conversations" in rec:
        turns = rec["conversations"]
        human = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None or human + 1 >= len(turns):
            return None
        prompt, reply = turns[human].get("value", ""), turns[human + 1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT \
                or prompt_len + reply_len > SHAREGPT_MAX_TOTAL:
            return None
        return BenchRequest(prompt, prompt_len, reply_len)
    prompt = rec.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{path}: record {index} has neither a non-empty 'prompt' string nor 'conversations'")
    wanted = output_len or rec.get("output_len") or FILE_DEFAULT_OUTPUT_LEN
    if not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"{path}: record {index} has a bad output_len {wanted!r}")
    return BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), wanted)
