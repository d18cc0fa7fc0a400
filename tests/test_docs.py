"""Every public docstring's Examples section runs and prints what it shows."""
import doctest
import importlib

import pytest

MODULES = ["cuattn.attention", "cuattn.elementwise", "cuattn.reference"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)  # cuattn.attention is also the function's name
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
