"""StructuredOutputsParams' own checks: exactly one spec, non-empty, within the size limit, and a
json schema that parses as a schema; every refusal an InvalidRequest naming structured_outputs."""

from __future__ import annotations

import pytest

from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import MAX_STRUCTURED_SPEC_BYTES, SamplingParams, StructuredOutputsParams


def refusal(**kwargs) -> str:
    with pytest.raises(InvalidRequest) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"
    return str(info.value)


@pytest.mark.parametrize("kwargs,set_names", [
    ({}, "none"),
    ({"json": "{}", "regex": "a"}, "json, regex"),
    ({"json_object": True, "choice": ["a"]}, "json_object, choice"),
])
def test_exactly_one_spec_is_set(kwargs, set_names):
    assert refusal(**kwargs) == ("structured_outputs must set exactly one of json, json_object, regex, choice, "
                                 f"grammar; got {set_names}")


@pytest.mark.parametrize("kwargs,message", [
    ({"choice": []}, "structured_outputs.choice must be a list of at least one string"),
    ({"choice": "yes"}, "structured_outputs.choice must be a list of at least one string"),
    ({"choice": ["yes", ""]}, "structured_outputs.choice must hold non-empty strings"),
    ({"choice": ["yes", 3]}, "structured_outputs.choice must hold non-empty strings"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
    ({"json_object": 1}, "structured_outputs.json_object must be a boolean, got 1"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema (an object or a boolean), got a list"),
    ({"json": "[" * 10_000 + "]" * 10_000}, "structured_outputs.json nests too deeply to parse"),
])
def test_empty_or_malformed_specs_are_refused(kwargs, message):
    assert refusal(**kwargs) == message


def test_json_that_does_not_parse_is_refused_with_the_parser_position():
    assert refusal(json='{"type": "object"') == ("structured_outputs.json is not valid JSON: Expecting ',' "
                                                 "delimiter: line 1 column 18 (char 17)")


def test_the_size_limit_counts_utf8_bytes_before_any_parsing():
    limit = MAX_STRUCTURED_SPEC_BYTES
    StructuredOutputsParams(regex="a" * limit)  # exactly at the limit
    over = f"structured_outputs.regex is longer than {limit} bytes of UTF-8, the limit"
    assert refusal(regex="a" * (limit + 1)) == over
    # Fewer characters than the limit, more bytes: two per "é".
    assert refusal(regex="é" * (limit // 2 + 1)) == over
    # Over the limit and not JSON: refused for its size, never parsed.
    assert refusal(json="{" * (limit + 1)).startswith("structured_outputs.json is longer than")
    # Choices count together.
    assert refusal(choice=["a" * (limit // 2), "b" * (limit // 2 + 1)]).startswith(
        "structured_outputs.choice is longer than")


def test_valid_specs_and_their_kind():
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    assert StructuredOutputsParams(json="true").kind == "json"  # a boolean schema
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex="[0-9]+").kind == "regex"
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"
    choice = StructuredOutputsParams(choice=("yes", "no"))
    assert (choice.kind, choice.choice) == ("choice", ["yes", "no"])


def test_sampling_params_takes_only_structured_outputs_params():
    so = StructuredOutputsParams(regex="a+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams().structured_outputs is None
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(structured_outputs={"regex": "a+"})
    assert info.value.param == "structured_outputs"
