"""A selection pattern written without the model's prefix (HF's `bert.`) says which one fits.

README's own example once read `select=["encoder.layer.11.*", "classifier"]`, which matches
nothing in HF's BertForSequenceClassification (its names start with `bert.`).
"""

from __future__ import annotations

import pytest

import tracinfunc as tif
from tests.lm_helpers import params_of, tiny_bert


def test_pattern_missing_the_model_prefix_names_the_pattern_and_the_fix():
    params = params_of(tiny_bert())
    expected = (r"\['encoder\.layer\.1\.\*'\] match no parameter; the parameters are "
                r"\[bert\.embeddings\.word_embeddings\.weight.*Did you mean "
                r"\['bert\.encoder\.layer\.1\.\*'\]\?")
    with pytest.raises(tif.errors.ParameterSelectionError, match=expected):
        tif.select_params(params, ["encoder.layer.1.*", "classifier"])
    chosen = tif.select_params(params, ["bert.encoder.layer.1.*", "classifier"])
    assert "classifier.weight" in chosen
    assert "bert.encoder.layer.0.output.dense.weight" not in chosen
    assert all(n.startswith(("bert.encoder.layer.1.", "classifier.")) for n in chosen)


def test_pattern_matching_under_no_prefix_gets_no_guess():
    params = params_of(tiny_bert())
    with pytest.raises(tif.errors.ParameterSelectionError) as error:
        tif.select_params(params, ["decoder.*"])
    assert "Did you mean" not in str(error.value)
