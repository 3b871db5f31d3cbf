"""A primitive's sharding rule: which dimensions are which factors, and which factors may be
partitioned with no communication. Plain Python over shapes and specs; no tracing here.

A rule names every dimension of every operand and result by a *factor*, einsum style, e.g. the
attention forward pass::

    operands  "b q (k g) d", "b s k d", "b s k e", "b"
    results   "b q (k g) e", "b (k g) q"
    parallel  ("b", "k")

``(k g)`` is a compound dimension (major factor first): query head ``h = k * G + g`` belongs
to kv head ``k``. A *parallel* factor can be split over mesh axes and every device computes its
block alone; every other factor must stay whole on each device. A parallel factor must be the
major (first) factor of every compound dimension it appears in, so that a block of it is a
contiguous block of the dimension: splitting ``k`` over 2 devices gives device 0 query heads
``[0, H/2)``, which read kv heads ``[0, Hkv/2)``, i.e. whole GQA groups.

The same rule serves the three places that need one:
  * ``shardy()``: the Shardy rule string for ``custom_partitioning`` (propagation);
  * ``assign()`` + ``specs()``: the partitioning decision (which mesh axes each parallel factor
    gets, given the operands' shardings), for ``custom_partitioning``'s callbacks and for the
    output shardings of explicitly sharded types;
  * ``shardy_attr()``: a textual ``#sdy.op_sharding_rule`` for a bare FFI custom call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence

Dim = tuple[str, ...]  # the factors of one dimension, major first: "(k g)" -> ("k", "g")
Axes = tuple[str, ...]  # mesh axis names that split one factor, major first

_TOKEN = re.compile(r"\(([^()]*)\)|([A-Za-z]\w*)|(\S)")


def _parse_array(text: str) -> tuple[Dim, ...]:
    """``"b q (k g) d"`` -> ``(("b",), ("q",), ("k", "g"), ("d",))``."""
    dims = []
    for compound, single, bad in _TOKEN.findall(text):
        if bad:
            raise ValueError(f"sharding rule {text!r}: unexpected character {bad!r}")
        factors = tuple(compound.split()) if compound else (single,)
        for f in factors:
            if not re.fullmatch(r"[A-Za-z]\w*", f):
                raise ValueError(f"sharding rule {text!r}: bad factor name {f!r}")
        if len(factors) == 0:
            raise ValueError(f"sharding rule {text!r}: empty compound dimension")
        dims.append(factors)
    return tuple(dims)


def _spec_axes(entry) -> Axes:
    """One PartitionSpec entry (None, "x" or ("x", "y")) -> a tuple of axis names."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _spec_entry(axes: Axes):
    """The inverse of ``_spec_axes``."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _shardy_name(index: int) -> str:
    """Shardy's textual factor names: i, j, ..., z, z_1, z_2, ..."""
    return chr(ord("i") + index) if index < 18 else f"z_{index - 17}"


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """Which dimensions are which factors (see the module docstring).

    Attributes:
      operands: one rule string per operand, e.g. ``"b q (k g) d"``.
      results: one rule string per result.
      parallel: factors that may be split over mesh axes with no communication; every other
        factor is kept whole (replicated) on each device.
    """

    operands: tuple[str, ...]
    results: tuple[str, ...]
    parallel: tuple[str, ...]

    def __post_init__(self):
        for name in ("operands", "results", "parallel"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        known = set(self.factors)
        for f in self.parallel:
            if f not in known:
                raise ValueError(f"parallel factor {f!r} does not occur in the rule")
        for text, dims in zip(self.operands + self.results, self.arrays):
            flat = [f for dim in dims for f in dim]
            if len(flat) != len(set(flat)):
                raise ValueError(f"sharding rule {text!r}: a factor occurs twice")
            for dim in dims:
                for f in dim[1:]:
                    if f in self.parallel:
                        raise ValueError(
                            f"sharding rule {text!r}: parallel factor {f!r} must be the major "
                            f"(first) factor of its compound dimension, so a block of it is "
                            f"contiguous"
                        )

    # ---- structure --------------------------------------------------------------------------

    @functools.cached_property
    def arrays(self) -> tuple[tuple[Dim, ...], ...]:
        """Parsed dimensions of every operand, then every result."""
        return tuple(_parse_array(t) for t in self.operands + self.results)

    @functools.cached_property
    def factors(self) -> tuple[str, ...]:
        """Every factor, in order of first appearance (Shardy numbers them this way)."""
        seen: dict[str, None] = {}
        for dims in self.arrays:
            for dim in dims:
                for f in dim:
                    seen.setdefault(f)
        return tuple(seen)

    @property
    def whole(self) -> tuple[str, ...]:
        """Factors that must stay whole on each device, in order of first appearance."""
        return tuple(f for f in self.factors if f not in self.parallel)

    @functools.cached_property
    def batch_factor(self) -> str | None:
        """The parallel factor that leads every operand and result, if any.

        Such a primitive is also *batch partitionable* in XLA's sense (its FFI target can be
        split along the leading dimension by XLA's own C++ partitioner).
        """
        leads = {dims[0] for dims in self.arrays if dims}
        if len(leads) == 1 and all(dims for dims in self.arrays):
            (dim,) = leads
            if len(dim) == 1 and dim[0] in self.parallel:
                return dim[0]
        return None

    def with_parallel(self, parallel: Sequence[str]) -> ShardingRule:
        return dataclasses.replace(self, parallel=tuple(parallel))

    def with_hidden_results(self, batch: int, shapes: Sequence[Sequence[int]]) -> ShardingRule:
        """The rule extended to results a lowering adds beyond the primitive's own (e.g. the
        CUDA call's float32 workspace, which nothing reads after the call).

        Each dimension is a new whole factor; a non-empty leading dimension that is a multiple
        of the batch size ``batch`` is ``(b w)``, since such a buffer is laid out batch-major
        and XLA's batch partitioner splits it along the batch like every other result.
        """
        results = list(self.results)
        for i, shape in enumerate(shapes):
            dims = [f"hidden{i}d{j}" for j in range(len(shape))]
            if self.batch_factor and shape and shape[0] and batch and shape[0] % batch == 0:
                dims[0] = f"({self.batch_factor} {dims[0]})"
            results.append(" ".join(dims))
        return dataclasses.replace(self, results=tuple(results))

    # ---- sizes ------------------------------------------------------------------------------

    def factor_sizes(
        self, operand_shapes: Sequence[Sequence[int]], result_shapes: Sequence[Sequence[int]] = ()
    ) -> dict[str, int]:
        """Every factor's size, from the operand shapes (and any result shapes given).

        A factor that fills a dimension alone takes its size; a compound dimension then gives
        its one remaining unknown factor (e.g. ``g = H / Hkv``).
        """
        if len(operand_shapes) != len(self.operands):
            raise ValueError(
                f"sharding rule has {len(self.operands)} operands, got {len(operand_shapes)} shapes"
            )
        texts = self.operands + self.results[: len(result_shapes)]
        dims_and_sizes = []
        shapes = list(operand_shapes) + list(result_shapes)
        for text, dims, shape in zip(texts, self.arrays, shapes):
            if len(dims) != len(shape):
                raise ValueError(f"sharding rule {text!r} has rank {len(dims)}, got shape {shape}")
            dims_and_sizes.extend(zip(dims, shape))
        sizes: dict[str, int] = {}
        for dim, size in dims_and_sizes:
            if len(dim) == 1:
                sizes.setdefault(dim[0], int(size))
        for dim, size in dims_and_sizes:
            unknown = [f for f in dim if f not in sizes]
            if len(unknown) == 1:
                known = math.prod(sizes[f] for f in dim if f in sizes)
                sizes[unknown[0]] = int(size) // known if known else 0
        missing = [f for f in self.factors if f not in sizes]
        if missing:
            raise ValueError(f"sharding rule: cannot infer the size of factors {missing}")
        return sizes

    # ---- Shardy -----------------------------------------------------------------------------

    def _shardy_arrays(self, sizes) -> tuple[tuple[Dim, ...], ...]:
        """``arrays`` without size-1 factors in compound dimensions, which Shardy rejects
        ("dim mapping can't have a factor of size 1 if there are multiple factors"): with
        MHA (``g = 1``) query heads are ``k``; with MQA (``k = 1``) they are ``g``."""

        def squeeze(dim):
            if len(dim) == 1:
                return dim
            kept = tuple(f for f in dim if sizes[f] != 1)
            return kept or dim[:1]

        return tuple(tuple(squeeze(dim) for dim in dims) for dims in self.arrays)

    @staticmethod
    def _text(dims) -> str:
        return " ".join(dim[0] if len(dim) == 1 else "(" + " ".join(dim) + ")" for dim in dims)

    def shardy(self, operand_shapes) -> tuple[str, dict]:
        """``(rule string, keyword arguments)`` for ``custom_partitioning``'s ``sharding_rule``.

        The keyword arguments name the factors kept whole (``need_replication_factors``, in
        order of first appearance: jax 0.10's verifier wants special factors sorted) and give
        the sizes of factors that occur only inside compound dimensions (jax rejects a size
        for a factor that fills some dimension alone).
        """
        sizes = self.factor_sizes(operand_shapes)
        arrays = self._shardy_arrays(sizes)
        present = {f for dims in arrays for dim in dims for f in dim}
        alone = {dim[0] for dims in arrays for dim in dims if len(dim) == 1}
        kwargs: dict = {f: sizes[f] for f in self.factors if f in present and f not in alone}
        whole = tuple(f for f in self.whole if f in present)
        if whole:
            kwargs["need_replication_factors"] = whole
        n_in = len(self.operands)
        text = ", ".join(map(self._text, arrays[:n_in])) + " -> "
        return text + ", ".join(map(self._text, arrays[n_in:])), kwargs

    def shardy_attr(self, operand_shapes, result_shapes=()) -> str:
        """The same rule as a textual ``#sdy.op_sharding_rule`` attribute."""
        sizes = self.factor_sizes(operand_shapes, result_shapes)
        arrays = self._shardy_arrays(sizes)
        present = {f for dims in arrays for dim in dims for f in dim}
        factors = [f for f in self.factors if f in present]
        index = {f: i for i, f in enumerate(factors)}

        def array(dims):  # [["b"], ["k", "g"]] -> "[i, kl]"
            names = ("".join(_shardy_name(index[f]) for f in dim) for dim in dims)
            return "[" + ", ".join(names) + "]"

        n_in = len(self.operands)
        text = "(" + ", ".join(array(d) for d in arrays[:n_in]) + ")"
        text += "->(" + ", ".join(array(d) for d in arrays[n_in:]) + ")"
        text += " {" + ", ".join(f"{_shardy_name(index[f])}={sizes[f]}" for f in factors) + "}"
        whole = [f for f in factors if f not in self.parallel]
        if whole:
            text += " need_replication={" + ", ".join(_shardy_name(index[f]) for f in whole) + "}"
        return f"#sdy.op_sharding_rule<{text}, custom>"

    # ---- partitioning decision ----------------------------------------------------------------

    def assign(
        self,
        operand_specs: Sequence[Sequence],
        operand_shapes: Sequence[Sequence[int]],
        axis_sizes: Mapping[str, int],
        *,
        strict: bool = False,
    ) -> dict[str, Axes]:
        """Mesh axes for each parallel factor, read from the operands' PartitionSpecs.

        A factor takes the axes of the first operand dimension it leads that is sharded; with
        ``strict`` (explicitly sharded types), two operands that shard one factor over different
        axes are an error instead. The longest prefix of those axes whose device count divides
        the factor's size is kept; the rest is dropped (that factor is then gathered before the
        call: correct, but with communication). An axis serves at most one factor.

        Worked example (H=8, Hkv=4, query heads sharded over ("x", "y") of sizes 2, 4): factor
        ``k`` (size 4) keeps ``("x",)``: 2 divides 4, 8 does not.
        """
        sizes = self.factor_sizes(operand_shapes)
        assignment: dict[str, Axes] = {}
        used: set[str] = set()
        for f in self.factors:
            if f not in self.parallel:
                continue
            found: list[tuple[int, Axes]] = []
            for i, (dims, spec) in enumerate(zip(self.arrays, operand_specs)):
                spec = tuple(spec) + (None,) * (len(dims) - len(spec))
                for dim, entry in zip(dims, spec):
                    if dim[0] == f and _spec_axes(entry):
                        found.append((i, _spec_axes(entry)))
            if not found:
                continue
            axes = found[0][1]
            if strict:
                for i, other in found[1:]:
                    if other != axes:
                        raise ValueError(
                            f"operands {found[0][0]} and {i} split factor {f!r} over different "
                            f"mesh axes ({axes} and {other}); reshard one of them "
                            f"(jax.sharding.reshard) so that they agree"
                        )
            keep: Axes = ()
            for a in axes:
                if a in used:
                    break
                if sizes[f] % (math.prod(axis_sizes[x] for x in keep) * axis_sizes[a]):
                    break
                keep += (a,)
            if keep:
                assignment[f] = keep
                used.update(keep)
        return assignment

    def specs(self, assignment: Mapping[str, Axes]) -> tuple[tuple[tuple, ...], tuple[tuple, ...]]:
        """PartitionSpec entries ``(operands, results)`` that realize ``assignment``.

        A dimension is split over its major factor's axes; everything else is whole.
        """
        out = tuple(
            tuple(_spec_entry(assignment.get(dim[0], ())) for dim in dims) for dims in self.arrays
        )
        return out[: len(self.operands)], out[len(self.operands) :]
