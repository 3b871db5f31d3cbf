"""The README's Python examples run as written, and its signature is the real one."""

from __future__ import annotations

import inspect
import pathlib
import re

import jax
import numpy as np

import jax_varlen

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_python_examples_run():
    blocks = _blocks((ROOT / "README.md").read_text(), "python")
    assert blocks, "the README has no Python example"
    for i, code in enumerate(blocks):
        scope: dict = {}
        exec(compile(code, f"README.md python block {i}", "exec"), scope)  # noqa: S102
        for value in scope.values():  # every array it made is finite (padding never leaks)
            if isinstance(value, jax.Array) and jax.numpy.issubdtype(value.dtype, np.floating):
                assert np.isfinite(np.asarray(value, np.float32)).all()


def test_documented_signature_is_the_real_one():
    """The signature blocks (README and docs/semantics.md) list the real keyword arguments
    and defaults of attention and reference, and of packed_attention and packed_reference."""
    for doc in ("README.md", "docs/semantics.md"):
        text = (ROOT / doc).read_text()
        for call, fns in (
            ("jax_varlen.attention(", (jax_varlen.attention, jax_varlen.reference)),
            ("jax_varlen.packed_attention(",
             (jax_varlen.packed_attention, jax_varlen.packed_reference)),
        ):
            sig = next(b for b in _blocks(text, "text") if call in b)
            for fn in fns:
                for name, p in inspect.signature(fn).parameters.items():
                    expected = (name if p.default is inspect.Parameter.empty
                                else f"{name}={p.default!r}")
                    assert expected in sig, f"{doc}: {expected} missing from the signature"


def test_docs_link_the_contract():
    readme = (ROOT / "README.md").read_text()
    assert "docs/semantics.md" in readme and "SPEC.md" not in readme
    assert (ROOT / "docs" / "semantics.md").exists()
