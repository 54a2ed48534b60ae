"""Marks for the tiers of the suite (tests/conftest.py sets the quick one by time)."""

import pytest

# A case whose property another test already checks on a cheaper or wider
# configuration: kept, but run only when asked (`pytest -m exhaustive`), as the
# full products of the test matrices are.
EXHAUSTIVE = (pytest.mark.slow, pytest.mark.exhaustive)
