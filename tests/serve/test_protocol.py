"""protocol.py's OpenAI options that an engine cannot honour (OFF_ONLY): each is accepted at
every value that means "off" and refused, naming the field with the table's words, at any other
-- never silently ignored."""
import pytest
from pydantic import ValidationError

from dspark_compile.serve.protocol import OFF_ONLY, CompletionRequest

# a value that is not "off", per field
ON = {"n": 2, "best_of": 3, "suffix": "", "logit_bias": {"5": 1.0},
      "presence_penalty": 0.5, "frequency_penalty": -1e-9, "repetition_penalty": 1.2}


def test_every_off_only_field_has_a_value_that_is_on():
    assert set(ON) == set(OFF_ONLY)


@pytest.mark.parametrize("field", sorted(OFF_ONLY))
def test_off_values_pass_and_any_other_is_refused_by_name(field):
    accepted, refusal = OFF_ONLY[field]
    for v in accepted:
        assert getattr(CompletionRequest(model="m", prompt="x", **{field: v}), field) == v
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt="x", **{field: ON[field]})
    err = e.value.errors()[0]
    assert err["loc"] == (field,) and err["msg"] == f"Value error, {refusal}", err


def test_the_float_zeros_are_off():
    """By ==, as JSON's 0, 0.0 and -0.0 all say "no penalty"."""
    for v in (0, 0.0, -0.0):
        CompletionRequest(model="m", prompt="x", presence_penalty=v, frequency_penalty=v)
    with pytest.raises(ValidationError, match="presence_penalty"):
        CompletionRequest(model="m", prompt="x", presence_penalty=float("nan"))
