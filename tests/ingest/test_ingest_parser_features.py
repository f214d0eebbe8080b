"""What the parser does with calls, loops, fusions, shard_map bodies and collective groups."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hespas_ml.ingest import IngestError, OpGraph, parse_module
from hespas_ml.ingest.export import export_jax

F32 = jax.ShapeDtypeStruct((8, 8), jnp.float32)


def ops_of(g: OpGraph, kind: str):
    return [op for op in g.ops if op.kind == kind]


# -- calls --------------------------------------------------------------------------------------

NESTED_CALLS = """
module @calls {
  func.func private @leaf(%a: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
  func.func private @mid(%a: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = func.call @leaf(%a) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = func.call @leaf(%0) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    return %1 : tensor<4x4xf32>
  }
  func.func @main(%a: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = func.call @mid(%a) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %1 = func.call @mid(%0) : (tensor<4x4xf32>) -> tensor<4x4xf32>
    %2 = stablehlo.tanh %1 : tensor<4x4xf32>
    return %2 : tensor<4x4xf32>
  }
}
"""


def test_nested_calls_are_counted_per_call_site_and_chained():
    g = parse_module(NESTED_CALLS)
    dots = ops_of(g, "dot_general")
    assert len(dots) == 4
    assert {op.func for op in dots} == {"main/mid/leaf"}
    # dataflow runs through the inlined calls: each dot consumes the previous one
    assert dots[0].operands == [-1, -1]
    for prev, op in zip(dots, dots[1:]):
        assert op.operands == [prev.id, prev.id]
    assert ops_of(g, "tanh")[0].operands == [dots[-1].id]
    assert g.outputs == [ops_of(g, "tanh")[0].id]


# -- while loops --------------------------------------------------------------------------------

def _loop_graph(fn, *args) -> OpGraph:
    return parse_module(export_jax(fn, *args), source=fn.__name__)


def test_fori_loop_trip_count():
    def fori(x):
        return jax.lax.fori_loop(0, 7, lambda i, a: jnp.tanh(a @ a), x)
    g = _loop_graph(fori, F32)
    assert [(lp.trip_count, lp.derived) for lp in g.loops] == [(7, True)]
    (dot,) = ops_of(g, "dot_general")
    assert dot.count == 7 and dot.loop == 0
    assert g.op_counts()["compare"] == 8          # the condition runs once more than the body
    assert not g.warnings


def test_scan_trip_count():
    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ c, c.sum()), x, None, length=11)
    g = _loop_graph(scanned, F32)
    assert [(lp.trip_count, lp.derived) for lp in g.loops] == [(11, True)]
    assert g.op_counts()["dot_general"] == 11


def test_while_with_loop_carried_limit():
    def counted(x):
        return jax.lax.while_loop(lambda s: s[0] < s[1], lambda s: (s[0] + 3, s[1], s[2] @ s[2]), (0, 20, x))
    g = _loop_graph(counted, F32)
    assert g.loops[0].trip_count == 7              # 0, 3, … 18
    assert g.op_counts()["dot_general"] == 7


def test_large_trip_count_is_extrapolated():
    def long(x):
        return jax.lax.fori_loop(0, 12_345_678, lambda i, a: a * 1.5, x)
    g = _loop_graph(long, F32)
    assert (g.loops[0].trip_count, g.loops[0].derived) == (12_345_678, True)
    assert ops_of(g, "multiply")[0].count == 12_345_678


def test_nested_loops_multiply_counts():
    def nested(x):
        inner = lambda i, a: jax.lax.fori_loop(0, 5, lambda j, b: b @ b, a)  # noqa: E731
        return jax.lax.fori_loop(0, 3, inner, x)
    g = _loop_graph(nested, F32)
    assert sorted(lp.trip_count for lp in g.loops) == [3, 5]
    inner = next(lp for lp in g.loops if lp.trip_count == 5)
    assert g.loops[inner.parent].trip_count == 3
    assert g.op_counts()["dot_general"] == 15


def test_loop_with_an_input_dependent_limit_is_counted_once_with_a_warning():
    def data_dependent(x, n):
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] @ s[1]), (0, x))[1]
    g = _loop_graph(data_dependent, F32, jax.ShapeDtypeStruct((), jnp.int32))
    assert [(lp.trip_count, lp.derived) for lp in g.loops] == [(1, False)]
    assert g.op_counts()["dot_general"] == 1
    assert any("trip count not derivable" in w for w in g.warnings)


XLA_COMPILED_LOOP = """
module @xla_loop attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {
  func.func private @wrapped_compare(%a: tensor<i32>, %b: tensor<i32>) -> tensor<i1> {
    %0 = "mhlo.fusion"(%a, %b) <{fusion_kind = #mhlo<fusion_kind kLoop>}> ({
    ^bb0(%x: tensor<i32>, %y: tensor<i32>):
      %1 = stablehlo.compare LT, %x, %y : (tensor<i32>, tensor<i32>) -> tensor<i1>
      mhlo.return %1 : tensor<i1>
    }) : (tensor<i32>, tensor<i32>) -> tensor<i1>
    return %0 : tensor<i1>
  }
  func.func @main(%arg0: tensor<8x8xf32>) -> tensor<8x8xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %0 = mhlo.copy %c0 : tensor<i32>
    %1:2 = stablehlo.while(%i = %0, %x = %arg0) : tensor<i32>, tensor<8x8xf32>
    cond {
      %c9 = stablehlo.constant dense<9> : tensor<i32>
      %2 = func.call @wrapped_compare(%i, %c9) : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %2 : tensor<i1>
    } do {
      %c1 = stablehlo.constant dense<1> : tensor<i32>
      %3 = "mhlo.fusion"(%i, %c1) <{fusion_kind = #mhlo<fusion_kind kLoop>}> ({
      ^bb0(%p: tensor<i32>, %q: tensor<i32>):
        %4 = stablehlo.add %p, %q : tensor<i32>
        mhlo.return %4 : tensor<i32>
      }) : (tensor<i32>, tensor<i32>) -> tensor<i32>
      %5 = "mhlo.fusion"(%x) <{fusion_kind = #mhlo<fusion_kind kOutput>}> ({
      ^bb0(%p: tensor<8x8xf32>):
        %6 = stablehlo.dot %p, %p : (tensor<8x8xf32>, tensor<8x8xf32>) -> tensor<8x8xf32>
        %7 = stablehlo.tanh %6 : tensor<8x8xf32>
        mhlo.return %7 : tensor<8x8xf32>
      }) : (tensor<8x8xf32>) -> tensor<8x8xf32>
      stablehlo.return %3, %5 : tensor<i32>, tensor<8x8xf32>
    }
    return %1#1 : tensor<8x8xf32>
  }
}
"""


def test_xla_compiled_loop_with_compare_inside_a_fusion_in_the_cond_function():
    g = parse_module(XLA_COMPILED_LOOP)
    assert [(lp.trip_count, lp.derived) for lp in g.loops] == [(9, True)]
    (dot,) = ops_of(g, "dot")
    (tanh,) = ops_of(g, "tanh")
    assert dot.count == 9 and dot.attrs["dot_dimension_numbers"]["lhs_contract"] == [1]
    assert ops_of(g, "compare")[0].count == 10
    # ops of one fusion share its id; different fusions (and the cond's) get different ids
    assert dot.fusion is not None and tanh.fusion == dot.fusion
    assert tanh.operands == [dot.id]
    add = ops_of(g, "add")[0]
    cmp = ops_of(g, "compare")[0]
    assert len({add.fusion, dot.fusion, cmp.fusion}) == 3
    assert ops_of(g, "copy")[0].fusion is None
    assert g.outputs == [tanh.id]


FUSIONS_IN_CALLS = """
module @fusions {
  func.func private @f(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = "mhlo.fusion"(%a) <{fusion_kind = #mhlo<fusion_kind kLoop>}> ({
    ^bb0(%p: tensor<4xf32>):
      %1 = stablehlo.exponential %p : tensor<4xf32>
      mhlo.return %1 : tensor<4xf32>
    }) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = func.call @f(%a) : (tensor<4xf32>) -> tensor<4xf32>
    %1 = func.call @f(%0) : (tensor<4xf32>) -> tensor<4xf32>
    %2 = stablehlo.negate %1 : tensor<4xf32>
    return %2 : tensor<4xf32>
  }
}
"""


def test_each_inlined_fusion_gets_its_own_id():
    g = parse_module(FUSIONS_IN_CALLS)
    exps = ops_of(g, "exponential")
    assert [op.fusion for op in exps] == [0, 1]
    assert exps[1].operands == [exps[0].id]
    assert ops_of(g, "negate")[0].fusion is None


# -- conditionals -------------------------------------------------------------------------------

def test_conditional_counts_its_largest_branch_with_a_warning():
    def branchy(p, x):
        return jax.lax.cond(p, lambda a: (a @ a) @ a, lambda a: a + 1.0, x)
    g = _loop_graph(branchy, jax.ShapeDtypeStruct((), jnp.bool_), F32)
    assert g.op_counts()["dot_general"] == 2
    assert "add" not in g.op_counts() or all(op.kind != "add" or op.fusion for op in g.ops)
    assert any("branches" in w for w in g.warnings)


# -- collectives --------------------------------------------------------------------------------

def _all_reduce(groups: str, attrs: str = "", module_attrs: str = "mhlo.num_partitions = 1 : i32, "
                "mhlo.num_replicas = 4 : i32", prelude: str = "") -> str:
    return f"""
module @m attributes {{{module_attrs}}} {{
  {prelude}
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {{
    %0 = "stablehlo.all_reduce"(%arg0) <{{replica_groups = {groups}{attrs}}}> ({{
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %1 = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %1 : tensor<f32>
    }}) : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }}
}}
"""


def groups_of(text: str) -> list[list[int]]:
    (op,) = [op for op in parse_module(text).ops if op.is_collective]
    return op.attrs["replica_groups"]


def test_dense_and_empty_replica_groups():
    assert groups_of(_all_reduce("dense<[[0, 2], [1, 3]]> : tensor<2x2xi64>")) == [[0, 2], [1, 3]]
    # empty = every replica in one group
    assert groups_of(_all_reduce("dense<> : tensor<0x0xi64>")) == [[0, 1, 2, 3]]


def test_channel_handle_and_body_are_decoded():
    text = _all_reduce("dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>",
                       ", channel_handle = #stablehlo.channel_handle<handle = 5, type = 1>, use_global_device_ids",
                       "mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32")
    (op,) = [op for op in parse_module(text).ops if op.is_collective]
    assert op.attrs["channel_handle"] == {"handle": 5, "type": 1}
    assert op.attrs["use_global_device_ids"] is True
    assert op.attrs["body_ops"] == 1
    assert [str(t) for t in op.operand_types] == ["8xf32"]


MESH = 'sdy.mesh @mesh = <["x"=2, "y"=4]>'
MESH_ATTRS = "mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32"
CHANNEL = ", channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, use_global_device_ids"


@pytest.mark.parametrize("axes, expected", [
    ('["y"]', [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ('["x"]', [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ('[#stablehlo.axis_ref<name = "x">]', [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ('["y", "x"]', [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ('[#sdy<axis_ref "y":(2)2>]', [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ('[#sdy<axis_ref "y":(1)2>]', [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ('[]', [[i] for i in range(8)]),
])
def test_mesh_axes_replica_groups_are_resolved_against_the_mesh(axes, expected):
    groups = f"#stablehlo.replica_group_mesh_axes<mesh = @mesh, axes = {axes}>"
    assert groups_of(_all_reduce(groups, CHANNEL, MESH_ATTRS, MESH)) == expected


def test_mesh_axes_groups_follow_the_mesh_device_order():
    mesh = 'sdy.mesh @mesh = <["x"=2, "y"=4], device_ids=[7, 6, 5, 4, 3, 2, 1, 0]>'
    groups = '#stablehlo.replica_group_mesh_axes<mesh = @mesh, axes = ["y"]>'
    assert groups_of(_all_reduce(groups, CHANNEL, MESH_ATTRS, mesh)) == [[7, 6, 5, 4], [3, 2, 1, 0]]


def test_mesh_axes_with_an_unknown_axis_is_a_clean_error():
    groups = '#stablehlo.replica_group_mesh_axes<mesh = @mesh, axes = ["z"]>'
    with pytest.raises(IngestError, match=r"line \d+: .*axis 'z'"):
        parse_module(_all_reduce(groups, CHANNEL, MESH_ATTRS, MESH), source="mesh.mlir")


MIXED_MODES = """
module @modes attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 2 : i32} {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = "stablehlo.all_reduce"(%arg0) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %3 = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %3 : tensor<f32>
    }) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = "stablehlo.collective_permute"(%0) <{channel_handle = #stablehlo.channel_handle<handle = 2, type = 1>, source_target_pairs = dense<[[0, 1], [1, 0]]> : tensor<2x2xi64>}> : (tensor<8xf32>) -> tensor<8xf32>
    %2 = "stablehlo.all_gather"(%1) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 3, type = 1>, replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> : (tensor<8xf32>) -> tensor<32xf32>
    %4 = stablehlo.slice %2 [0:8] : (tensor<32xf32>) -> tensor<8xf32>
    return %4 : tensor<8xf32>
  }
}
"""


def test_replica_and_partition_ids_become_device_ids():
    g = parse_module(MIXED_MODES)
    ar, cp, ag = [op for op in g.ops if op.is_collective]
    assert g.n_devices == 4
    assert ar.attrs["replica_groups"] == [[0, 2], [1, 3]]            # cross-replica, per partition
    assert cp.attrs["source_target_pairs"] == [[0, 1], [1, 0], [2, 3], [3, 2]]   # cross-partition
    assert ag.attrs["replica_groups"] == [[0, 1, 2, 3]]               # replicas × all partitions


SHARD_MAP = """
module @jit_f attributes {mhlo.num_partitions = 4 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["d"=4]>
  func.func public @main(%arg0: tensor<16x8xf32>) -> tensor<16x8xf32> {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"d"}, {}]>] out_shardings=[<@mesh, [{"d"}, {}]>] manual_axes={"d"} (%arg1: tensor<4x8xf32>) {
      %1 = stablehlo.tanh %arg1 : tensor<4x8xf32>
      %2 = "stablehlo.all_reduce"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>, use_global_device_ids}> ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %3 = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %3 : tensor<f32>
      }) : (tensor<4x8xf32>) -> tensor<4x8xf32>
      sdy.return %2 : tensor<4x8xf32>
    } : (tensor<16x8xf32>) -> tensor<16x8xf32>
    %4 = stablehlo.negate %0 : tensor<16x8xf32>
    return %4 : tensor<16x8xf32>
  }
}
"""


def test_manual_computation_bodies_are_inlined_with_local_shapes():
    g = parse_module(SHARD_MAP)
    tanh, ar, neg = g.ops
    assert (tanh.kind, ar.kind, neg.kind) == ("tanh", "all_reduce", "negate")
    assert tanh.operands == [-1] and str(tanh.result_types[0]) == "4x8xf32"
    assert ar.operands == [tanh.id] and ar.attrs["replica_groups"] == [[0, 1], [2, 3]]
    assert neg.operands == [ar.id] and str(neg.result_types[0]) == "16x8xf32"
    assert g.n_devices == 4 and g.inputs[0].shape == (4, 8)        # main's argument as one device holds it


def test_module_name_and_inputs():
    g = parse_module(NESTED_CALLS, source="calls.mlir")
    assert g.name == "calls" and g.source == "calls.mlir"
    assert [str(t) for t in g.inputs] == ["4x4xf32"]


def test_device_count_is_inferred_when_the_module_declares_none():
    bare = _all_reduce("dense<[[0, 1, 2, 3, 4, 5]]> : tensor<1x6xi64>", module_attrs="")
    g = parse_module(bare.replace("module @m attributes {}", "module @m"))
    assert g.n_devices == 6
    assert [w for w in g.warnings if "inferred" in w] == [
        "module declares no device count; 6 devices inferred from its device groups"]


COMPOSITE = """
module @comp {
  func.func private @gelu_impl(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.tanh %a : tensor<4xf32>
    %1 = stablehlo.multiply %0, %a : tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.composite "my.gelu" %a {decomposition = @gelu_impl} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.negate %0 : tensor<4xf32>
    return %1 : tensor<4xf32>
  }
}
"""


def test_composites_are_inlined_from_their_decomposition():
    g = parse_module(COMPOSITE)
    assert [op.kind for op in g.ops] == ["tanh", "multiply", "negate"]
    assert g.ops[2].operands == [g.ops[1].id]
    assert g.ops[0].func == "main/gelu_impl"


def test_reducer_bodies_are_summarised_not_inlined():
    def pooled(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 2), (2, 2), "VALID").sum()
    g = _loop_graph(pooled, F32)
    window = ops_of(g, "reduce_window")[0]
    assert window.attrs["body_ops"] == 1
    assert ops_of(g, "reduce")[0].attrs["body_ops"] == 1
    assert "maximum" not in g.op_counts()          # the body is not a graph op


def test_a_module_declaring_one_device_over_a_larger_mesh_runs_on_the_mesh():
    """What jax.export writes for a program over an abstract mesh: one device declared (none was there to
    count), the mesh and its device groups naming all of them."""
    one = "mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32"
    g = parse_module(_all_reduce("dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>", CHANNEL, one, MESH))
    assert g.n_devices == 8
    assert next(op for op in g.ops if op.kind == "all_reduce").attrs["replica_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(IngestError, match="but the program has 1 devices"):   # without a mesh, one device
        parse_module(_all_reduce("dense<[[0, 1, 2, 3], [4, 5, 6, 7]]> : tensor<2x4xi64>", CHANNEL, one, ""))
