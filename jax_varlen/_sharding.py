"""Sharding for this package's primitives: one ``register(...)`` call per primitive.

Given a primitive, its :class:`ShardingRule` and its per-platform FFI lowerings, ``register``
makes the primitive work, with no communication along the rule's parallel factors, under

* **sharded ``jit``** (``in_shardings``, sharded arguments, Auto or Explicit mesh axes): the
  primitive lowers through ``jax.experimental.custom_partitioning`` with a Shardy rule (and the
  GSPMD callbacks, for ``jax_use_shardy_partitioner=False``). Its partition callback reads the
  operands' shardings, keeps the parallel factors' mesh axes (batch, whole kv-head groups) and
  makes every other dimension whole; each device then calls the FFI target on its block.
* **``jax.export``**: ``custom_partitioning`` cannot be serialized: it lowers to a custom call
  whose ``backend_config`` is the ``id()`` of a Python object of the exporting process, and the
  FFI call itself only appears when XLA calls back into that object. So when lowering for
  export the primitive lowers to its bare FFI call instead, and marks it *batch partitionable*
  (frontend attribute ``num_batch_dims = "1"``, target registered with
  ``jax.ffi.register_ffi_target_as_batch_partitionable``, and a Shardy rule whose only parallel
  factor is the batch). XLA's own C++ partitioner then splits the leading batch dimension, in
  the deserializing process too. **Limit:** an exported function split over heads gathers the
  heads before the call (correct results, one all-gather); use ``shard_map`` (fully manual,
  exports as is) to split heads in exported code.
* **``shard_map``**: inside a fully manual region ``custom_partitioning`` steps aside and the
  FFI call runs on the local blocks. The abstract evaluation marks results as varying over
  every manual axis any operand varies over, so ``check_vma`` catches a wrong ``out_specs``.
* **Explicit sharding types** (``AxisType.Explicit`` meshes, the default of
  ``jax.make_mesh`` in jax 0.10): the abstract evaluation gives results the shardings the rule
  implies (operands that split one factor over different axes are an error there).

Mesh axes that do not divide a parallel factor (e.g. 2 devices for 3 kv heads) are dropped for
that factor: the call still gives the unsharded result, after gathering that dimension.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_varlen._sharding_rule import ShardingRule

__all__ = ["ShardingRule", "register", "rule_of"]

# primitive -> the rule register() gave it (tests check the rules the primitives really use).
_RULES: dict[Primitive, ShardingRule] = {}


def rule_of(primitive: Primitive) -> ShardingRule:
    """The sharding rule ``primitive`` was registered with."""
    return _RULES[primitive]


def register(primitive: Primitive, rule: ShardingRule, *, abstract_eval, lowerings, targets=()):
    """Declares how ``primitive`` partitions; replaces its abstract eval and lowerings.

    Args:
      primitive: the primitive the public API binds (its jaxprs, batching and AD rules are
        unaffected: partitioning happens at lowering time).
      rule: the factor rule; ``rule.parallel`` lists what may be split with no communication.
      abstract_eval: ``(*avals, **params) -> aval or list of avals`` on global shapes.
      lowerings: ``{platform: lowering}``; each lowering emits the bare FFI call for the
        shapes it is given (global or per-device).
      targets: the FFI target names those lowerings call; registered as batch partitionable
        when ``rule`` has a batch factor (the export path relies on it).
    """
    _RULES[primitive] = rule
    # The per-device call. custom_partitioning's callbacks bind it on local blocks, and lower
    # it directly when there is nothing to partition (one device, fully manual shard_map).
    local = Primitive(primitive.name + "_local")
    local.multiple_results = primitive.multiple_results
    local.def_abstract_eval(abstract_eval)
    partitioned = _custom_partitioned(rule, local)
    for platform, lowering in lowerings.items():
        mlir.register_lowering(local, lowering, platform=platform)
        mlir.register_lowering(
            primitive,
            functools.partial(_lower, rule, partitioned, lowering, primitive.multiple_results),
            platform=platform,
        )
    primitive.def_abstract_eval(functools.partial(_typed_abstract_eval, rule, abstract_eval))
    _require_devices_during_lowering(primitive)
    if rule.batch_factor is not None:
        for target in targets:
            jax.ffi.register_ffi_target_as_batch_partitionable(target)


# --------------------------------------------------------------------------------------------
# Lowering: custom_partitioning, or the bare FFI call when exporting.


def _require_devices_during_lowering(primitive):
    """custom_partitioning needs the device assignment while lowering; jit only supplies it to
    jaxprs holding a primitive from this (private) set, as custom_partitioning's own primitive
    is. TransformerEngine's JAX primitives register the same way. Without it (a future jax that
    drops the set), ``_lower`` falls back to the batch-partitionable call."""
    try:
        from jax._src import dispatch

        dispatch.prim_requires_devices_during_lowering.add(primitive)
    except (ImportError, AttributeError):
        pass


def _exporting(ctx) -> bool:
    params = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(params, "for_export", False))


def _devices_known(ctx) -> bool:
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, mlir.ShardingContext):
        return getattr(axis_context, "device_assignment", None) is not None
    return True


def _lower(rule, partitioned, lowering, multiple_results, ctx, *args, **params):
    if _exporting(ctx) or not _devices_known(ctx):
        return _lower_for_export(rule, lowering, ctx, *args, **params)
    frozen = tuple(sorted(params.items()))  # custom_partitioning's static args must hash
    return mlir.lower_fun(
        lambda *xs: partitioned(frozen, *xs), multiple_results=multiple_results
    )(ctx, *args)


def _lower_for_export(rule, lowering, ctx, *args, **params):
    """The bare FFI call, marked so that XLA's C++ partitioner splits its batch axis."""
    results = lowering(ctx, *args, **params)
    if rule.batch_factor is None:
        # Nothing XLA may split (operands that do not all lead with the batch, e.g. a paged
        # cache): the call runs whole, and its lowering may be more than the one FFI call.
        return results
    op = results[0].owner
    attrs = {"num_batch_dims": mlir.ir.StringAttr.get("1")}
    if "mhlo.frontend_attributes" in op.attributes:
        old = mlir.ir.DictAttr(op.attributes["mhlo.frontend_attributes"])
        attrs = {**{a.name: a.attr for a in old}, **attrs}
    op.attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(attrs)
    # A Shardy rule gives every factor a number; a symbolic (shape-polymorphic) batch has none
    # until the deserializing process refines the shapes, so such a call goes without one.
    static = all(isinstance(d, int) for aval in ctx.avals_in for d in aval.shape)
    if static and getattr(jax.config, "jax_use_shardy_partitioner", False):
        batch_only = rule.with_parallel([rule.batch_factor])
        shapes = [aval.shape for aval in ctx.avals_in]
        result_shapes = [tuple(mlir.ir.RankedTensorType(r.type).shape) for r in op.results]
        hidden = result_shapes[len(rule.results):]
        if hidden:
            batch_only = batch_only.with_hidden_results(shapes[0][0] if shapes[0] else 0, hidden)
        text = batch_only.shardy_attr(shapes, result_shapes)
        op.attributes["sdy.sharding_rule"] = mlir.ir.Attribute.parse(text)
    return results


def _custom_partitioned(rule: ShardingRule, local: Primitive):
    """A custom_partitioning function ``(params, *operands) -> results`` binding ``local``."""

    def bind(params, *operands):
        out = local.bind(*operands, **dict(params))
        return tuple(out) if local.multiple_results else out

    fn = custom_partitioning(bind, static_argnums=(0,))

    def decide(mesh, arg_shapes):
        """NamedShardings (operands, results) per the rule, from the operands' shardings."""
        specs = [_spec_of(a) for a in arg_shapes]
        shapes = [a.shape for a in arg_shapes]
        assignment = rule.assign(specs, shapes, dict(mesh.shape))
        in_specs, out_specs = rule.specs(assignment)
        to_sharding = lambda spec: NamedSharding(mesh, P(*spec))  # noqa: E731
        args = tuple(map(to_sharding, in_specs))
        results = tuple(map(to_sharding, out_specs))
        return args, (results if local.multiple_results else results[0])

    def partition(params, mesh, arg_shapes, result_shape):
        arg_shardings, result_shardings = decide(mesh, arg_shapes)
        return mesh, functools.partial(bind, params), result_shardings, arg_shardings

    def infer_sharding_from_operands(params, mesh, arg_shapes, result_shape):
        return decide(mesh, arg_shapes)[1]

    def sharding_rule(params, mesh, operand_types, result_types):
        return rule.shardy([tuple(mlir.ir.RankedTensorType(t).shape) for t in operand_types])

    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=sharding_rule,
    )
    return fn


def _spec_of(shape_with_sharding) -> tuple:
    """The PartitionSpec entries of a callback argument (replicated if not a NamedSharding)."""
    sharding = getattr(shape_with_sharding, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return tuple(spec) if spec is not None else ()


# --------------------------------------------------------------------------------------------
# Abstract evaluation: result types under explicit sharding and inside shard_map.


def _typed_abstract_eval(rule, abstract_eval, *avals, **params):
    outs = abstract_eval(*avals, **params)
    multiple = isinstance(outs, (tuple, list))
    typed = _with_result_shardings(rule, avals, list(outs) if multiple else [outs])
    typed = _with_varying_axes(avals, typed)
    return type(outs)(typed) if multiple else typed[0]


def _with_result_shardings(rule, avals, outs):
    """Results typed with the shardings the rule implies for the operands' (explicit) ones."""
    meshes = [getattr(getattr(a, "sharding", None), "mesh", None) for a in avals]
    mesh = next((m for m in meshes if m is not None and not m.empty), None)
    if mesh is None:
        return outs
    specs = [tuple(a.sharding.spec) for a in avals]
    assignment = rule.assign(specs, [a.shape for a in avals], dict(mesh.shape), strict=True)
    _, out_specs = rule.specs(assignment)
    return [o.update(sharding=NamedSharding(mesh, P(*s))) for o, s in zip(outs, out_specs)]


def _with_varying_axes(avals, outs):
    """Inside shard_map, a result varies over every manual axis that some operand varies over
    (``aval.manual_axis_type.varying``, jax 0.10 to 0.12). Without this the results would look
    invariant, and ``check_vma`` would accept an ``out_specs`` that drops a varying axis."""
    if not all(hasattr(a, "manual_axis_type") for a in avals):
        return outs
    varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
    if not varying:
        return outs
    make = type(avals[0].manual_axis_type)
    return [o.update(manual_axis_type=make(varying=varying)) for o in outs]
