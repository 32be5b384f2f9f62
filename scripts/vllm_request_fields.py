"""Write vLLM's OpenAI request fields and their defaults (tests/data/vllm_request_fields.json),
which tests/router/openai/test_vllm_fields.py holds pagefleet's requests to.

Run with the python of a venv that has vLLM (e.g. benchmarks' vLLM CPU venv):
    VLLM_TARGET_DEVICE=cpu /work/vllm-cpu-venv/bin/python scripts/vllm_request_fields.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_request_fields.json"


def _default(field):
    try:
        value = field.get_default(call_default_factory=True)
        json.dumps(value)
        return value
    except Exception:  # noqa: BLE001 — a required field, or a default JSON cannot hold
        return repr(field.get_default())


def main() -> None:
    import vllm
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    out = {"vllm_version": vllm.__version__,
           "how": "field -> default of vLLM's CompletionRequest / ChatCompletionRequest (pydantic model_fields), "
                  "written by scripts/vllm_request_fields.py with vLLM's CPU venv; request_id's default (a "
                  "random id) stored as null"}
    for api, model in (("completions", CompletionRequest), ("chat_completions", ChatCompletionRequest)):
        fields = {name: _default(f) for name, f in sorted(model.model_fields.items())}
        fields["request_id"] = None
        out[api] = fields
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} (vLLM {vllm.__version__})")


if __name__ == "__main__":
    main()
