"""What the structured-outputs tests share."""

from __future__ import annotations

import json

from pagefleet.worker.sampling_params import StructuredOutputsParams


def expensive_schema(tag: str) -> StructuredOutputsParams:
    """A short schema that takes seconds to compile even on the tiny demo tokenizer (a bounded
    repetition of 1,600 to 3,200 in a pattern; 5 s on an idle core), one per ``tag``."""
    pattern = f"^(a|bc|[0-9]{tag}){{1600,3200}}$"
    return StructuredOutputsParams(json=json.dumps({"type": "string", "pattern": pattern}))
