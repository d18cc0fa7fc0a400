"""Every public docstring's Examples section runs and prints what it shows."""
import doctest
import importlib

import pytest

MODULES = ["cuattn.attention", "cuattn.elementwise", "cuattn.merge", "cuattn.reference",
           "cuattn.layers", "cuattn.cache"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)  # cuattn.attention is also the function's name
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _readme_blocks(kind):
    """The ```python blocks of README.md that follow a ``<!-- doctest: KIND -->`` line."""
    import re
    text = (ROOT / "README.md").read_text()
    pattern = re.compile(r"<!-- doctest: (\w+) -->\s*```python\n(.*?)```", re.S)
    return [body for k, body in pattern.findall(text) if k == kind]


def _run_readme_blocks(kind):
    """Run the README's blocks of ``kind`` as doctests; every one must pass."""
    blocks = _readme_blocks(kind)
    assert blocks, f"README.md has no example marked <!-- doctest: {kind} -->"
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(
        optionflags=doctest.NORMALIZE_WHITESPACE)
    for i, body in enumerate(blocks):
        test = parser.get_doctest(body, {}, f"README.md {kind} example {i}", "README.md", 0)
        assert test.examples, "the README example has no >>> lines"
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="not a source checkout")
def test_readme_numpy_example_runs():
    _run_readme_blocks("numpy")


@pytest.mark.gpu
def test_readme_cupy_example_runs():
    _run_readme_blocks("cupy")


@pytest.mark.skipif(not (ROOT / "README.md").is_file(), reason="not a source checkout")
def test_the_repository_refers_to_no_file_outside_it():
    """The contract lives in the repository's own docs: no shared planning files named."""
    import re
    names = re.compile(r"\b(API|PERF|DESIGN|METHOD|CONVENTIONS)\.md\b")
    files = [p for d in ("cuattn", "cuda", "docs", "tests", "tools") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".cu", ".cuh", ".rst", ".md", ".txt") and p.is_file()]
    files += [ROOT / "README.md", ROOT / "setup.py", ROOT / "pyproject.toml"]
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in files if p.name != "test_docs.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if names.search(line)]
    assert not hits, hits
