"""Transformer zoo families (llama, gpt, vit, moe): specs, FLOPs against the analytical count, the
collectives of every parallel strategy, scan loops, determinism, a 3B-parameter export, the CLI."""
from __future__ import annotations

import time

import pytest

from hespas_ml.ingest import IngestError, OpGraph, TensorType
from hespas_ml.ingest.zoo import ZOO, parse_zoo_spec, zoo_program
from hespas_ml.ingest.zoo import gpt as gpt_family
from hespas_ml.ingest.zoo import llama as llama_family
from hespas_ml.ingest.zoo import moe as moe_family
from hespas_ml.ingest.zoo import vit as vit_family
from hespas_ml.ingest.zoo.cache import export_in_subprocess
from hespas_ml.costs import graph_cost
from tests.ingest.zoo_checks import kinds, load, matrix_flops

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

# small configurations: d_model 64, 4 heads (head size 16)
LLAMA = "zoo:llama?layers=2&d_model=64&heads=4&kv_heads=2&ffn=128&vocab=256&seq=16&batch=8"
GPT = "zoo:gpt?layers=2&d_model=64&heads=4&vocab=1000&seq=16&batch=8"
VIT = "zoo:vit?image=16&patch=4&layers=2&d_model=64&heads=4&mlp=128&classes=10&batch=8"
MOE = "zoo:moe?layers=2&d_model=64&heads=4&experts=4&top_k=2&ffn=128&vocab=256&seq=16&batch=8"
ALL_DEVICES = [[0, 1, 2, 3]]


def executions(g: OpGraph, kind: str) -> int:
    return sum(op.count for op in kinds(g, kind))


def inputs_numel(g: OpGraph, n: int) -> int:
    return sum(t.numel for t in g.inputs[:n])


def dot_operands(g: OpGraph) -> set[TensorType]:
    """Operand types of the matmuls (inside shard_map bodies these are the per-device shapes)."""
    return {x for op in kinds(g, "dot_general") for x in op.operand_types}


def t(*shape_and_dtype) -> TensorType:
    *shape, dtype = shape_and_dtype
    return TensorType(tuple(shape), dtype)


# -- specs ------------------------------------------------------------------------------------------

def test_families_are_registered_with_documented_parameters():
    for name in ("llama", "gpt", "vit", "moe"):
        entry = ZOO[name]
        assert {"layers", "d_model", "heads", "dtype", "step", "devices", "parallel", "scan"} <= \
            {p.name for p in entry.params}
        assert all(p.help for p in entry.params)
    assert "ep" in ZOO["moe"].param("parallel").choices and "ep" not in ZOO["llama"].param("parallel").choices
    for name in ("llama", "vit", "moe"):
        assert {"dp", "fsdp", "tp", "dp-partitioned", "fsdp-partitioned", "tp-partitioned"} <= \
            set(ZOO[name].param("parallel").choices)


@pytest.mark.parametrize("spec, message", [
    ("zoo:llama?heads=6&devices=4&parallel=tp&d_model=384", "heads=6 is not divisible by devices=4"),
    ("zoo:llama?heads=8&kv_heads=2&devices=4&parallel=tp-partitioned", "kv_heads=2 is not divisible by devices=4"),
    ("zoo:llama?batch=6&devices=4&parallel=fsdp", "batch=6 is not divisible by devices=4"),
    ("zoo:llama?heads=8&kv_heads=3", "kv_heads=3 does not divide heads=8"),
    ("zoo:llama?d_model=100&heads=8", "d_model=100 is not divisible by heads=8"),
    ("zoo:llama?d_model=24&heads=8", "head size d_model/heads=3 is odd"),
    ("zoo:llama?parallel=ep", "parallel=ep is not one of"),
    ("zoo:vit?image=30&patch=4", "patch=4 does not divide image=30"),
    ("zoo:vit?heads=6&devices=4&parallel=tp", "heads=6 is not divisible by devices=4"),
    ("zoo:vit?mlp=102&heads=4&d_model=64&devices=4&parallel=tp", "mlp=102 is not divisible by devices=4"),
    ("zoo:moe?experts=6&devices=4&parallel=ep", "experts=6 is not divisible by devices=4"),
    ("zoo:moe?batch=2&devices=4&parallel=ep", "batch=2 is not divisible by devices=4"),
    ("zoo:moe?top_k=3&experts=2", "top_k=3 is more than experts=2"),
    ("zoo:moe?heads=8&kv_heads=3", "kv_heads=3 does not divide heads=8"),
    ("zoo:moe?heads=8&kv_heads=2&devices=4&parallel=tp", "kv_heads=2 is not divisible by devices=4"),
    ("zoo:moe?capacity=0", "capacity=0.0 is below the minimum 0.01"),
    ("zoo:moe?group=48&seq=16&batch=8", "group=48 does not divide the 128 tokens (batch·seq)"),
    ("zoo:moe?group=64&seq=16&batch=8&devices=4&parallel=ep", "group=64 does not divide the 32 tokens of a device"),
    ("zoo:llama?heads=8&kv_heads=8&mesh=dp:2,tp:16&devices=32", "tp 16 does not divide heads 8"),
    ("zoo:llama?mesh=dp:2,tp:4&devices=4", "mesh=dp:2,tp:4 spans 8 devices, not devices=4"),
    ("zoo:llama?mesh=sp:2&devices=2", "mesh axis 'sp' is not one of pp, dp, fsdp, ep, cp, tp"),
    ("zoo:llama?seq=30&mesh=cp:4&devices=4", "cp 4 does not divide seq 30"),
    ("zoo:llama?seq=20&mesh=cp:2,tp:4&devices=8&sp=true", "sp=true: tp 4 × cp 2 does not divide seq 20"),
    ("zoo:llama?layers=4&mesh=pp:3&devices=3", "pp 3 does not divide layers 4"),
    ("zoo:llama?batch=8&mesh=pp:2,dp:2&devices=4&microbatch=3",
     "microbatch 3 does not divide the 4 sequences each dp × fsdp shard holds"),
    ("zoo:llama?devices=4&parallel=dp-partitioned&remat=full", "write mesh=dp:4 instead of parallel=dp-partitioned"),
    ("zoo:llama?mesh=pp:2&devices=2&schedule=zb", "schedule=zb is not one of gpipe, 1f1b, interleaved:V"),
    ("zoo:llama?mesh=pp:2&devices=2&schedule=interleaved:1", "interleaved needs V ≥ 2 chunks per stage"),
    ("zoo:llama?mesh=dp:2&devices=2&schedule=interleaved:2", "give the mesh a pp axis"),
    ("zoo:llama?seq=30&mesh=tp:4&devices=4&sp=true", "sp=true: tp 4 does not divide seq 30"),
    ("zoo:llama?layers=4&mesh=pp:2&devices=2&schedule=interleaved:4",
     "schedule=interleaved:4: pp 2 × 4 chunks does not divide layers 4"),
    ("zoo:llama?layers=4&batch=6&mesh=pp:2&devices=2&microbatch=2&schedule=interleaved:2",
     "the 3 microbatches must be a multiple of pp 2"),
    ("zoo:gpt?remat=most", "remat=most is not one of none, selective, full"),
    ("zoo:llama?mesh=dp:2,dp:2&devices=4", "mesh axis 'dp' is given twice"),
    ("zoo:llama?mesh=dp:3,tp:2&devices=6&batch=8", "dp × fsdp = 3 does not divide batch 8"),
    ("zoo:llama?mesh=ep:2&devices=2", "ep 2 splits experts: this model has none (the moe family does)"),
    ("zoo:moe?mesh=ep:3&devices=3&batch=9", "ep 3 does not divide experts 8"),
    ("zoo:moe?mesh=dp:2,ep:2&devices=4&batch=6", "dp × fsdp × ep = 4 does not divide batch 6"),
    ("zoo:llama?mesh=dp:2,tp:4&devices=8&parallel=tp", "leave parallel=tp out"),
    ("zoo:gpt?heads=12&mesh=dp:2,tp:8&devices=16", "tp 8 does not divide heads 12"),
    ("zoo:gpt?d_model=100&heads=8", "d_model=100 is not divisible by heads=8"),
])
def test_impossible_combinations_are_rejected_in_one_line(spec, message):
    with pytest.raises(IngestError) as info:
        parse_zoo_spec(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


# -- llama --------------------------------------------------------------------------------------------

def llama_forward_flops(layers, d, heads, kv, ffn, vocab, seq, batch) -> int:
    """Matmul FLOPs of a Llama forward pass: 2 per multiply-add of every projection and the LM head,
    plus QKᵀ and PV over the full seq×seq score matrix."""
    hd = d // heads
    per_token = layers * (d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ffn) + d * vocab
    attention = layers * 2 * 2 * batch * seq * seq * heads * hd
    return 2 * batch * seq * per_token + attention


def test_llama_inference_step_flops_and_parameters():
    g = load(f"{LLAMA}&step=infer")
    expected = llama_forward_flops(2, 64, 4, 2, 128, 256, 16, 8)
    assert matrix_flops(g) == pytest.approx(expected, rel=1e-9)
    assert graph_cost(g)["flops"] == pytest.approx(expected, rel=0.05)   # norms, softmax, RoPE: a few %
    params = parse_zoo_spec(LLAMA)[1]
    assert llama_family.forward_flops(params) == expected
    # inputs: every parameter, then the tokens
    assert g.inputs[-1] == t(8, 16, "i32")
    assert inputs_numel(g, len(g.inputs) - 1) == llama_family.parameter_count(params)
    assert not any(op.is_collective for op in g.ops)
    assert len(kinds(g, "gather")) == 1                   # the embedding lookup
    assert executions(g, "dot_general") == 2 * 9 + 1      # q k v scores pv o gate up down, LM head


def test_llama_training_step_is_three_forward_passes_in_bf16_with_adam():
    g = load(f"{LLAMA}&dtype=bf16&optimizer=adam&tied=true")
    expected = 3 * llama_forward_flops(2, 64, 4, 2, 128, 256, 16, 8)
    assert matrix_flops(g) == pytest.approx(expected, rel=1e-9)
    assert graph_cost(g)["flops"] == pytest.approx(expected, rel=0.05)
    assert {op.dtype for op in kinds(g, "dot_general")} == {"bf16"}
    n_leaves = 2 * 9 + 2                                   # tied: no separate head matrix
    assert len(g.inputs) == 3 * n_leaves + 1 + 2           # params, m, v, step, tokens, targets
    assert executions(g, "sqrt") >= n_leaves


def test_llama_scan_is_a_loop_with_one_trip_per_layer():
    unrolled = load(LLAMA)
    g = load(f"{LLAMA.replace('layers=2', 'layers=3')}&scan=true")
    assert len(g.loops) == 2                               # forward and backward scans
    assert all(lp.derived and lp.trip_count == 3 for lp in g.loops)
    assert any(op.loop is not None and op.kind == "dot_general" for op in g.ops)
    assert matrix_flops(g) == pytest.approx(3 * llama_forward_flops(3, 64, 4, 2, 128, 256, 16, 8), rel=1e-9)
    # the same model unrolled has as many dot executions per layer
    per_layer_unrolled = (executions(unrolled, "dot_general") - 3) / 2
    assert (executions(g, "dot_general") - 3) / 3 == per_layer_unrolled


def test_llama_dp_sums_every_gradient():
    g = load(f"{LLAMA}&devices=4&parallel=dp")
    assert g.n_devices == 4
    reduces = kinds(g, "all_reduce")
    assert len(reduces) == 2 * 9 + 3 + 1                   # each parameter's gradient, plus the loss
    assert all(op.attrs["replica_groups"] == ALL_DEVICES for op in reduces)
    assert t(2, 16, "i32") in g.inputs                     # the arguments are one device's: 8/4 sequences …
    assert kinds(g, "gather")[0].result_types[0] == t(2, 16, 64, "f32")   # … each device embeds 8/4 rows
    assert matrix_flops(g) == pytest.approx(3 * llama_forward_flops(2, 64, 4, 2, 128, 256, 16, 2), rel=1e-9)


def test_llama_fsdp_gathers_parameters_and_reduce_scatters_gradients():
    g = load(f"{LLAMA}&devices=4&parallel=fsdp")
    n_leaves = 2 * 9 + 3
    assert len(kinds(g, "all_gather")) == n_leaves == len(kinds(g, "reduce_scatter"))
    assert len(kinds(g, "all_reduce")) == 1                # the loss
    # each device holds parameters split along their largest axis and gathers them whole
    pairs = {(str(op.operand_types[0]), str(op.result_types[0])) for op in kinds(g, "all_gather")}
    assert {("64x64xf32", "256x64xf32"), ("64x64xf32", "64x256xf32"), ("64x32xf32", "64x128xf32"),
            ("16xf32", "64xf32")} <= pairs                 # embedding, head, w_gate/w_up, norms
    scattered = {(str(op.operand_types[0]), str(op.result_types[0])) for op in kinds(g, "reduce_scatter")}
    assert {(b, a) for a, b in pairs} == scattered         # gradients: the gathers in reverse
    # inference: the same gathers, no gradients
    gi = load(f"{LLAMA}&devices=4&parallel=fsdp&step=infer")
    assert len(kinds(gi, "all_gather")) == n_leaves and not kinds(gi, "reduce_scatter")
    # recomputing the layers, the backward gathers each layer's parameters again (FSDP frees them after use)
    for remat in ("selective", "full"):
        gr = load(f"{LLAMA}&devices=4&mesh=fsdp:4&remat={remat}")
        assert len(kinds(gr, "all_gather")) == n_leaves + 2 * 9 and len(kinds(gr, "reduce_scatter")) == n_leaves


def test_llama_tp_all_reduces_after_attention_and_mlp_and_splits_the_vocabulary():
    gi = load(f"{LLAMA}&devices=2&parallel=tp&step=infer")
    # attention-out and MLP-down of each layer, and the embedding (each device looks up its own rows)
    assert len(kinds(gi, "all_reduce")) == 2 * 2 + 1
    assert all(str(op.result_types[0]) == "8x16x64xf32" for op in kinds(gi, "all_reduce"))
    g = load(f"{LLAMA}&devices=2&parallel=tp")
    # and their mirror images backward with the head's input gradient; the vocabulary-parallel loss sums the
    # maximum, the exponentials and the targets' logits over the devices
    shapes = sorted(str(op.result_types[0]) for op in kinds(g, "all_reduce"))
    assert shapes == ["8x16x64xf32"] * 10 + ["8x16xf32"] * 3
    # heads split: wk [64, 32] -> [64, 16], wo [64, 64] -> [32, 64]; MLP [64, 128] -> [64, 64]; the LM head
    # [64, 256] -> [64, 128] and the embedding table [256, 64] -> [128, 64]
    operands = dot_operands(g)
    assert {t(64, 16, "f32"), t(32, 64, "f32"), t(64, 64, "f32"), t(64, 128, "f32")} <= operands
    assert t(64, 256, "f32") not in operands and t(128, 64, "f32") in g.inputs and t(256, 64, "f32") not in g.inputs
    # per device every matmul halves, the LM head's too
    assert matrix_flops(g) == pytest.approx(3 * llama_forward_flops(2, 64, 4, 2, 128, 256, 16, 8) / 2, rel=1e-9)


# -- gpt ----------------------------------------------------------------------------------------------

VOCAB_PARALLEL_CHECK = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from hespas_ml.ingest.zoo import transformer as tf
from hespas_ml.ingest.zoo.parallel import Collectives

V, D, B, S, T = 64, 8, 2, 5, 4
k = jax.random.split(jax.random.PRNGKey(0), 3)
table = jax.random.normal(k[0], (V, D))
head = jax.random.normal(k[1], (D, V))
tokens = jax.random.randint(k[2], (B, S), 0, V)
targets = (tokens * 7 + 3) % V

def plain(table, head):
    x = jnp.take(table, tokens, axis=0)
    return tf.lm_loss(jnp.tanh(x) @ head, targets)

mesh = Mesh(np.array(jax.devices()[:T]), ("tp",))
col = Collectives("mesh", T, mesh_axes={"tp": "tp"})

def split(table, head):
    x = tf.vocab_embed(table, tokens, col)
    return tf.vocab_loss(tf.vocab_head(jnp.tanh(x), head, col), targets, col)

sharded = jax.jit(jax.shard_map(jax.value_and_grad(split, argnums=(0, 1)), mesh=mesh,
                        in_specs=(P("tp", None), P(None, "tp")), out_specs=(P(), (P("tp", None), P(None, "tp"))),
                        check_vma=False))
(l1, (g1t, g1h)) = jax.value_and_grad(plain, argnums=(0, 1))(table, head)
(l2, (g2t, g2h)) = sharded(table, head)
np.testing.assert_allclose(l1, l2, rtol=1e-5)
np.testing.assert_allclose(g1t, g2t, rtol=1e-4, atol=1e-6)
np.testing.assert_allclose(g1h, g2h, rtol=1e-4, atol=1e-6)
"""


def test_the_vocabulary_parallel_embedding_head_and_loss_equal_the_whole_ones():
    """On 4 host devices: the loss and the gradients of the embedding table and the head, split over the
    vocabulary as Megatron splits them, equal those of the whole table and head on one device."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", VOCAB_PARALLEL_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_gpt_pads_its_vocabulary_as_megatron_does():
    def padded(spec):
        return gpt_family.sizes(parse_zoo_spec(spec)[1])["padded_vocab"]

    assert padded("zoo:gpt") == 50304                                    # GPT-2's 50,257 tokens, one device
    assert padded("zoo:gpt?heads=16&d_model=1024&parallel=tp&devices=8") == 51200    # a multiple of 128 x 8
    assert padded("zoo:gpt?heads=16&d_model=1024&mesh=dp:4,tp:4&devices=16") == 50688
    assert gpt_family.parameter_count(parse_zoo_spec("zoo:gpt")[1]) == 124_475_904   # GPT-2 small, padded


def test_gpt_inference_step_flops_and_parameters():
    g = load(f"{GPT}&step=infer")
    params = parse_zoo_spec(GPT)[1]
    assert gpt_family.sizes(params)["padded_vocab"] == 1024
    d, ffn, seq, tokens = 64, 256, 16, 8 * 16
    expected = 2 * tokens * (2 * (4 * d * d + 2 * d * ffn + 2 * seq * d) + d * 1024)
    assert gpt_family.forward_flops(params) == expected
    assert matrix_flops(g) == pytest.approx(expected, rel=1e-9)
    assert g.inputs[-1] == t(8, 16, "i32")
    assert inputs_numel(g, len(g.inputs) - 1) == gpt_family.parameter_count(params)
    assert executions(g, "dot_general") == 2 * 8 + 1      # q k v scores pv o, the two MLP matrices; LM head


def test_gpt_tp_adds_each_split_layers_bias_once_after_its_all_reduce():
    g = load(f"{GPT}&devices=2&parallel=tp")
    # attention-out and MLP-down, forward and backward; the embedding, the head's input gradient and the
    # vocabulary-parallel loss's three sums
    assert len(kinds(g, "all_reduce")) == 4 * 2 + 1 + 1 + 3
    operands = dot_operands(g)
    assert {t(64, 32, "f32"), t(32, 64, "f32"), t(64, 128, "f32"), t(128, 64, "f32")} <= operands
    assert t(64, 512, "f32") in operands                     # the tied head: half of the padded 1,024 columns
    assert matrix_flops(g) == pytest.approx(3 * gpt_family.forward_flops(parse_zoo_spec(GPT)[1]) / 2, rel=1e-9)
    one = load(GPT)
    assert len(one.inputs) == len(g.inputs)                  # the same parameters, split or replicated


@pytest.mark.parametrize("parallel", ["dp-partitioned", "fsdp-partitioned", "tp-partitioned"])
def test_llama_compiler_partitioned(parallel):
    g = load(f"{LLAMA.replace('kv_heads=2', 'kv_heads=4')}&devices=4&parallel={parallel}")
    assert g.n_devices == 4 and g.num_partitions == 4
    collectives = [op for op in g.ops if op.is_collective]
    assert collectives, "XLA's partitioner inserted collectives"
    for op in collectives:
        assert op.attrs["replica_groups"] == ALL_DEVICES
    inputs = set(g.inputs)
    if parallel == "dp-partitioned":
        assert t(2, 16, "i32") in inputs and t(64, 128, "f32") in inputs       # batch split, params whole
    elif parallel == "fsdp-partitioned":
        assert t(64, 64, "f32") in inputs and t(256, 64, "f32") not in inputs   # embedding split on vocab
        assert kinds(g, "all_gather")
    else:
        assert t(64, 32, "f32") in inputs and t(64, 128, "f32") not in inputs   # w_gate split on ffn
        assert t(8, 16, "i32") in inputs                                        # batch replicated
        assert kinds(g, "all_reduce")
    # XLA fused the program; the dots are still the global ones split over 4 devices (or replicated)
    if parallel == "dp-partitioned":
        assert matrix_flops(g) == pytest.approx(3 * llama_forward_flops(2, 64, 4, 4, 128, 256, 16, 2), rel=1e-6)


LLAMA_SMALL = "zoo:llama?layers=2&d_model=128&heads=4&vocab=512&seq=64&batch=8&step=train"


@pytest.mark.parametrize("parallel", ["dp", "fsdp", "tp"])
def test_a_one_axis_mesh_is_the_strategy_of_that_name(parallel):
    from hespas_ml import simulate

    one = simulate(f"{LLAMA_SMALL}&parallel={parallel}&devices=4", target="H100", system="ring:4x100")
    mesh = simulate(f"{LLAMA_SMALL}&mesh={parallel}:4&devices=4", target="H100", system="ring:4x100")
    assert (mesh.step_time_s, mesh.n_comp_nodes, mesh.n_comm_nodes, mesh.peak_memory_bytes) == \
           (one.step_time_s, one.n_comp_nodes, one.n_comm_nodes, one.peak_memory_bytes)


def test_a_three_axis_mesh_places_tp_innermost_and_dp_outermost():
    g = load(f"{LLAMA_SMALL}&mesh=dp:2,fsdp:2,tp:2&devices=8")
    assert g.n_devices == 8
    groups = {(op.kind, tuple(map(tuple, op.attrs["replica_groups"]))) for op in g.ops if op.is_collective}
    tp, fsdp, dp = ((0, 1), (2, 3), (4, 5), (6, 7)), ((0, 2), (1, 3), (4, 6), (5, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))
    assert ("all_reduce", tp) in groups                          # Megatron's all-reduces, inside a node
    assert ("all_gather", fsdp) in groups and ("reduce_scatter", fsdp) in groups
    assert ("all_reduce", dp) in groups                          # gradients over the data-parallel replicas
    assert ("all_reduce", ((0, 2, 4, 6), (1, 3, 5, 7))) in groups   # the loss over dp × fsdp
    # the program's arguments are what one device holds: a quarter of each 128x128 attention matrix (heads
    # over tp, d_model over fsdp), a sixteenth of the 8x64 batch of tokens
    shapes = {str(t) for t in g.inputs}
    assert "64x64xf32" in shapes and "128x128xf32" not in shapes and "2x64xi32" in shapes


def test_exports_are_deterministic(monkeypatch, tmp_path):
    """Two fresh exports on this machine give the very bytes: text and partitioned bytecode."""
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))      # the first export is made here, not read
    one_layer = LLAMA.replace("layers=2", "layers=1")
    for spec in (f"{LLAMA}&devices=2&parallel=tp&step=infer",
                 f"{one_layer}&devices=2&parallel=tp-partitioned&step=infer"):
        family, params = parse_zoo_spec(spec)
        first = zoo_program(spec)
        assert export_in_subprocess(family, params, spec) == first


def test_llama_3b_exports_and_ingests():
    spec = ("zoo:llama?layers=28&d_model=3072&heads=24&kv_heads=8&ffn=8192&vocab=128256&tied=true"
            "&seq=2048&batch=8&dtype=bf16&optimizer=adam")
    params = parse_zoo_spec(spec)[1]
    t0 = time.perf_counter()
    g = load(spec)
    seconds = time.perf_counter() - t0
    n_leaves = 28 * 9 + 2
    n_params = inputs_numel(g, n_leaves)
    assert n_params == llama_family.parameter_count(params)
    assert 3.0e9 < n_params < 3.5e9
    assert matrix_flops(g) == pytest.approx(
        3 * llama_forward_flops(28, 3072, 24, 8, 8192, 128256, 2048, 8), rel=1e-9)
    print(f"\nllama 3.2B train step (bf16, Adam): {len(g.ops)} ops, load {seconds:.1f} s")


# -- vit ----------------------------------------------------------------------------------------------

def vit_forward_flops(image, patch, layers, d, mlp, classes, batch, cls=True) -> tuple[int, int]:
    """(patch-embedding FLOPs, all matmul/conv FLOPs) of a ViT forward pass."""
    n = (image // patch) ** 2
    tokens = n + (1 if cls else 0)
    embed = 2 * batch * n * patch * patch * 3 * d
    per_layer = 2 * batch * tokens * (4 * d * d + 2 * d * mlp) + 2 * 2 * batch * tokens * tokens * d
    return embed, embed + layers * per_layer + 2 * batch * d * classes


@pytest.mark.parametrize("variant", ["embed=conv&pool=cls", "embed=dense&pool=mean"])
def test_vit_inference_and_training_flops(variant):
    embed, total = vit_forward_flops(16, 4, 2, 64, 128, 10, 8, cls="cls" in variant)
    gi = load(f"{VIT}&{variant}&step=infer")
    assert matrix_flops(gi) == pytest.approx(total, rel=1e-9)
    assert graph_cost(gi)["flops"] == pytest.approx(total, rel=0.05)
    assert len(kinds(gi, "convolution")) == (1 if "conv" in variant else 0)
    params = parse_zoo_spec(f"{VIT}&{variant}")[1]
    assert inputs_numel(gi, len(gi.inputs) - 1) == vit_family.parameter_count(params)
    g = load(f"{VIT}&{variant}")
    # backward: two matmuls per forward matmul, but the images need no gradient
    assert matrix_flops(g) == pytest.approx(3 * total - embed, rel=1e-9)


def test_vit_sharded_forms():
    tp = load(f"{VIT}&devices=2&parallel=tp&dtype=bf16")
    assert len(kinds(tp, "all_reduce")) == 4 * 2
    assert {op.dtype for op in kinds(tp, "all_reduce")} == {"bf16"}
    fsdp = load(f"{VIT}&devices=4&parallel=fsdp&scan=true")
    assert all(lp.trip_count == 2 and lp.derived for lp in fsdp.loops) and len(fsdp.loops) == 2
    gathers = kinds(fsdp, "all_gather")
    assert any(op.loop is not None for op in gathers)      # layer parameters gathered inside the loop
    assert executions(fsdp, "all_gather") == executions(fsdp, "reduce_scatter")
    part = load(f"{VIT.replace('layers=2', 'layers=1')}&devices=2&parallel=tp-partitioned")
    assert part.n_devices == 2 and kinds(part, "all_reduce")
    assert t(64, 32, "f32") in part.inputs                     # q/k/v split by heads
    assert t(64, 128, "f32") not in part.inputs and t(128, 64, "f32") not in part.inputs   # MLP split


# -- moe ----------------------------------------------------------------------------------------------

def moe_forward_flops(layers, d, heads, experts, top_k, capacity, ffn, vocab, seq, batch, group,
                      kv_heads=None) -> tuple[int, int]:
    """(dispatch einsum FLOPs, all matmul FLOPs) of an MoE decoder forward pass on ``batch`` sequences
    whose tokens are routed in groups of ``group`` (``kv_heads``: key/value heads, default ``heads``)."""
    import math
    tokens = batch * seq
    slots = math.ceil(top_k * group * capacity / experts)    # per expert and group
    kv_width = (kv_heads or heads) * (d // heads)             # width of the k and v projections
    attention = 2 * tokens * (2 * d * d + 2 * d * kv_width) + 2 * 2 * batch * seq * seq * d
    router = 2 * tokens * d * experts
    dispatch = 2 * tokens * experts * slots * d            # [G,t,e,c] x [G,t,d]; combine is as large
    expert_mlp = 3 * 2 * experts * (tokens // group) * slots * d * ffn
    per_layer = attention + router + 2 * dispatch + expert_mlp
    return layers * dispatch, layers * per_layer + 2 * tokens * d * vocab


def test_moe_inference_and_training_flops():
    dispatch, total = moe_forward_flops(2, 64, 4, 4, 2, 1.25, 128, 256, 16, 8, group=16)
    gi = load(f"{MOE}&step=infer")
    assert matrix_flops(gi) == pytest.approx(total, rel=1e-9)
    assert graph_cost(gi)["flops"] == pytest.approx(total, rel=0.05)
    params = parse_zoo_spec(MOE)[1]
    assert inputs_numel(gi, len(gi.inputs) - 1) == moe_family.parameter_count(params)
    assert moe_family.forward_flops(params) == {"dispatch": dispatch, "total": total}
    g = load(f"{MOE}&dtype=bf16")
    assert matrix_flops(g) == pytest.approx(3 * total - dispatch, rel=1e-9)   # the routing mask has no gradient
    # experts run batched: [experts, slots, d] x [experts, d, ffn]; 8 groups of 16 tokens (one sequence)
    # with ceil(2·16·1.25/4) = 10 slots each
    expert_dots = [op for op in kinds(g, "dot_general") if str(op.operand_types[1]) == "4x64x128xbf16"]
    assert expert_dots and str(expert_dots[0].operand_types[0]) == "4x80x64xbf16"


def test_moe_attention_can_share_key_value_heads_like_mixtral():
    gqa = f"{MOE}&kv_heads=2&step=infer"
    g = load(gqa)
    dispatch, total = moe_forward_flops(2, 64, 4, 4, 2, 1.25, 128, 256, 16, 8, group=16, kv_heads=2)
    assert matrix_flops(g) == pytest.approx(total, rel=1e-9)
    params = parse_zoo_spec(gqa)[1]
    assert inputs_numel(g, len(g.inputs) - 1) == moe_family.parameter_count(params)
    assert moe_family.forward_flops(params) == {"dispatch": dispatch, "total": total}
    # k and v project to 2 heads of 16; the scores are [batch, kv heads, queries per kv head, seq, seq]
    assert t(64, 32, "f32") in g.inputs and t(64, 64, "f32") in g.inputs
    scores = [op for op in kinds(g, "dot_general") if sorted(op.result_types[0].shape) == [2, 2, 8, 16, 16]]
    assert scores                                    # (einsum picks the axis order)
    assert load(f"{MOE}&kv_heads=4&step=infer").inputs == load(f"{MOE}&step=infer").inputs   # 4 = heads: MHA


def test_moe_expert_parallel_dispatches_with_all_to_all():
    gi = load(f"{MOE}&devices=4&parallel=ep&step=infer")
    a2a = kinds(gi, "all_to_all")
    assert len(a2a) == 2 * 2                                # to the experts and back, per layer
    assert all(op.attrs["replica_groups"] == ALL_DEVICES for op in a2a)
    # 2 sequences per device, 10 slots per expert and sequence: 4 devices send 20 slots to each expert
    assert str(a2a[0].result_types[0]) == "1x80x64xf32"
    g = load(f"{MOE}&devices=4&parallel=ep")
    assert len(kinds(g, "all_to_all")) == 4 * 2
    assert t(1, 64, 128, "f32") in dot_operands(g) and t(4, 64, 128, "f32") not in dot_operands(g)
    # replicated parameters (attention, router, norms, embedding, head) are summed, expert ones are not
    assert len(kinds(g, "all_reduce")) == 2 * 7 + 3 + 1
    dispatch, total = moe_forward_flops(2, 64, 4, 4, 2, 1.25, 128, 256, 16, 2, group=16)
    assert matrix_flops(g) == pytest.approx(3 * total - dispatch, rel=1e-9)


def test_moe_other_strategies():
    tp = load(f"{MOE}&devices=2&parallel=tp&step=infer")
    assert len(kinds(tp, "all_reduce")) == 2 * 2 and not kinds(tp, "all_to_all")
    assert t(4, 64, 64, "f32") in dot_operands(tp)           # every expert's hidden units split
    assert t(4, 64, 128, "f32") not in dot_operands(tp)
    fsdp = load(f"{MOE}&devices=2&parallel=fsdp&scan=true")
    assert [lp.trip_count for lp in fsdp.loops] == [2, 2]
    assert executions(fsdp, "all_gather") == executions(fsdp, "reduce_scatter") > 0
    part = load(f"{MOE.replace('layers=2', 'layers=1')}&devices=4&parallel=ep-partitioned")
    assert part.n_devices == 4 and any(op.is_collective for op in part.ops)
    assert t(1, 64, 128, "f32") in part.inputs               # experts split by XLA's partitioner


# -- the command line ----------------------------------------------------------------------------------

def test_cli_simulates_a_llama_on_a_ring(capsys):
    from hespas_ml.cli.main import main

    rc = main(["simulate", "zoo:llama?layers=2&d_model=64&heads=4&ffn=128&vocab=256&seq=16&batch=8&parallel=tp",
               "--system", "ring:4x150"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(4 devices)" in out and "step time" in out


def test_moe_on_a_mesh_splits_the_experts_over_ep_and_sends_tokens_to_them_with_all_to_all():
    """mesh=ep:4 is parallel=ep's program; with dp and tp beside it each expert group spans the ep axis only,
    a device holds 8 / 2 experts of 768 / 2 hidden units, and the non-expert gradients are summed over dp × ep."""
    alone, mesh = load("zoo:moe?devices=4&parallel=ep&batch=8"), load("zoo:moe?mesh=ep:4&devices=4&batch=8")
    for kind in ("all_to_all", "all_reduce"):
        assert len(kinds(mesh, kind)) == len(kinds(alone, kind)) > 0
    assert matrix_flops(mesh) == matrix_flops(alone)
    g = load("zoo:moe?mesh=dp:2,ep:2,tp:2&devices=8&batch=8")
    groups = {(op.kind, tuple(map(tuple, op.attrs["replica_groups"]))) for op in g.ops if op.is_collective}
    assert {gr for kind, gr in groups if kind == "all_to_all"} == {((0, 2), (1, 3), (4, 6), (5, 7))}  # ep: stride 2
    assert "4x256x384xf32" in {str(t) for t in g.inputs}             # w_gate: experts / ep, hidden units / tp
    assert ("all_reduce", ((0, 2, 4, 6), (1, 3, 5, 7))) in groups    # the non-expert gradients over dp × ep
