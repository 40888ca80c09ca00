"""docs/numpy.md is generated from the derivative table and must be current."""
import pathlib

from adtape import numpy_docs

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "numpy.md"


def test_the_list_of_supported_functions_is_current():
    assert DOCS.read_text() == numpy_docs.render(), (
        "docs/numpy.md is out of date: run python -m adtape.numpy_docs > docs/numpy.md")


def test_every_function_and_primitive_is_listed():
    text = DOCS.read_text()
    import adtape.numpy as anp
    for name in set(anp._FUNCTIONS) | set(anp._LINALG) | set(anp._EXTRA):
        assert f"`{name}`" in text, name
    for name in numpy_docs._primitives():
        assert f"| `{name}` |" in text, name
