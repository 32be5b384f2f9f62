"""``--routing ray_prefix``: the text Ray Serve LLM's prefix router matches for a token-id
prompt (one character per token, salted by the request's cache salt)."""

from pagefleet.router.routing.ray_prefix_router import TOKEN_CHAR_BASE, prompt_text
from pagefleet.worker import SamplingParams
from pagefleet.worker.replica.wire import WorkerRequest


def request(tokens: list[int], salt: tuple = ()) -> WorkerRequest:
    return WorkerRequest("r", tokens, SamplingParams(), extra_keys=salt)


def test_one_character_per_token_so_a_token_prefix_is_a_text_prefix():
    text = prompt_text(request([0, 7, 31_999]))
    assert text == "\x00" + chr(TOKEN_CHAR_BASE) + chr(TOKEN_CHAR_BASE + 7) + chr(TOKEN_CHAR_BASE + 31_999)
    longer = prompt_text(request([0, 7, 31_999, 12]))
    assert longer.startswith(text) and len(longer) == len(text) + 1


def test_the_same_tokens_under_two_cache_salts_share_no_prefix():
    a, b = prompt_text(request([5, 6], ("tenant-1",))), prompt_text(request([5, 6], ("tenant-2",)))
    assert a == "tenant-1\x00" + chr(TOKEN_CHAR_BASE + 5) + chr(TOKEN_CHAR_BASE + 6)
    assert a[:7] == b[:7] and a[7] != b[7]


def test_the_same_tokens_under_two_adapters_share_no_prefix():
    base = prompt_text(request([5, 6]))
    sql = prompt_text(WorkerRequest("r", [5, 6], SamplingParams(), lora_name="sql"))
    chat = prompt_text(WorkerRequest("r", [5, 6], SamplingParams(), lora_name="chat"))
    assert sql == "\x01sql\x00" + chr(TOKEN_CHAR_BASE + 5) + chr(TOKEN_CHAR_BASE + 6)
    assert len({base[0], sql[0]}) == 2 and sql[1] != chat[1]
