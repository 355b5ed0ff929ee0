"""Fixtures of the tests/hf/test_generate_*.py modules (test_chunked_prefill.py and test_generate_runner.py
compile with other options and define their own ``pair``)."""

import pytest

from .generate_models import FAMILIES, compiled_pair, compiled_small


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    """(stock model, unimem-compiled model with the same weights, family name): :func:`compiled_pair`."""
    return compiled_pair(request.param)


@pytest.fixture(scope="module")
def small():
    """:func:`compiled_small`."""
    return compiled_small()
