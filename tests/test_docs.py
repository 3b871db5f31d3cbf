"""The Python examples of the README, docs/semantics.md and docs/paged.md run as written and
check their own results; the documented signatures are the real ones."""

from __future__ import annotations

import inspect
import pathlib
import re

import jax
import numpy as np
import pytest

import jax_varlen

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/semantics.md", "docs/paged.md")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def _python_examples() -> list:
    """Every ```python block of DOCS, as a pytest param with id ``doc:line``."""
    params = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            line = text.count("\n", 0, m.start()) + 1
            params.append(pytest.param(doc, line, m.group(1), id=f"{doc}:{line}"))
    return params


EXAMPLES = _python_examples()


def test_docs_have_examples():
    """The README shows the causal prefill; semantics.md shows the worked mask and the four
    common cases (prefill, decode, chunked prefill, packed training)."""
    per_doc = {doc: [code for d, _, code in (p.values for p in EXAMPLES) if d == doc]
               for doc in DOCS}
    assert any("nonpad_q_seqlen=lens" in c and "is_causal=True" in c
               for c in per_doc["README.md"])
    semantics = "\n".join(per_doc["docs/semantics.md"])
    for needle in ("nonpad_q_seqlen=lens", "k_cache", "chunk", "packed_attention",
                   "jax.grad", "query_seq_lengths"):
        assert needle in semantics, f"docs/semantics.md: no example with {needle!r}"


@pytest.mark.parametrize("doc, line, code", EXAMPLES)
def test_doc_python_examples_run(doc, line, code):
    """Runs the block; it must check its result (an assert or np.testing) and leave only
    finite arrays behind (padding never leaks)."""
    assert re.search(r"\bassert\b|np\.testing\.assert", code), (
        f"{doc}:{line}: the example checks nothing")
    scope: dict = {}
    exec(compile(code, f"{doc} python block at line {line}", "exec"), scope)  # noqa: S102
    for name, value in scope.items():
        if isinstance(value, jax.Array) and jax.numpy.issubdtype(value.dtype, np.floating):
            assert np.isfinite(np.asarray(value, np.float32)).all(), f"{doc}:{line}: {name}"


def test_documented_signature_is_the_real_one():
    """The signature blocks (README and docs/semantics.md) list the real keyword arguments
    and defaults of attention and packed_attention, which reference and packed_reference
    take too."""
    for doc in ("README.md", "docs/semantics.md"):
        text = (ROOT / doc).read_text()
        for call, fns in (
            ("jax_varlen.attention(", (jax_varlen.attention, jax_varlen.reference)),
            ("jax_varlen.packed_attention(",
             (jax_varlen.packed_attention, jax_varlen.packed_reference)),
        ):
            sig = next(b for b in _blocks(text, "text") if call in b)
            op, oracle = fns
            for name, p in inspect.signature(op).parameters.items():
                expected = (name if p.default is inspect.Parameter.empty
                            else f"{name}={p.default!r}")
                assert expected in sig, f"{doc}: {expected} missing from the signature"
                # The oracle takes every argument of the op, with the same default (it may
                # take more: the masks the op does not have yet, README "API").
                theirs = inspect.signature(oracle).parameters.get(name)
                assert theirs is not None and theirs.default == p.default, (
                    f"{oracle.__name__} lacks {expected}")


def test_docs_link_the_contract():
    readme = (ROOT / "README.md").read_text()
    assert "docs/semantics.md" in readme and "SPEC.md" not in readme
    assert (ROOT / "docs" / "semantics.md").exists()
