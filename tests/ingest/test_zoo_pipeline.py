"""Pipeline parallelism, microbatches and activation recomputation in the transformer families: what the
exported per-device programs hold, and that their steps replay alike on every rank (send/recv included)."""
from __future__ import annotations

import pytest

from hespas_ml import simulate
from hespas_ml.ingest.zoo.specs import parse_zoo_spec
from hespas_ml.ingest.zoo.checks import pipeline_bubble
from hespas_ml.replay import load_system
from hespas_ml.replay.embedded import replay_embedded
from hespas_ml.replay.fast import replay_fast
from hespas_ml.replay.traces import build_traces
from hespas_ml.split.regions import split_program
from tests.ingest.zoo_checks import kinds, load

pytestmark = pytest.mark.slow   # exports programs

LLAMA = "zoo:llama?layers=4&d_model=64&heads=4&kv_heads=2&ffn=128&vocab=256&seq=16&batch=8&step=train"
GPT = "zoo:gpt?layers=4&d_model=64&heads=4&vocab=1000&seq=16&batch=8&step=train"


def groups_of(g, kind: str) -> set[tuple]:
    return {tuple(map(tuple, op.attrs["replica_groups"])) for op in kinds(g, kind)}


def test_a_pipeline_passes_each_tick_to_the_next_stage_around_a_ring():
    # pp 2 outermost: devices 0-1 are the first stage, 2-3 the second; 8 sequences over dp 2 in microbatches
    # of 1: 4 microbatches, so 4 + 2 - 1 = 5 ticks forward and 5 backward
    g = load(f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1")
    permutes = kinds(g, "collective_permute")
    # forward to the next stage, backward (the gradients) to the previous one: on two stages, the same ring
    ring = {(0, 2), (1, 3), (2, 0), (3, 1)}
    assert [set(map(tuple, op.attrs["source_target_pairs"])) for op in permutes] == [ring, ring]
    assert sorted(op.count for op in permutes) == [5, 5]
    assert ((0, 1), (2, 3)) in groups_of(g, "all_reduce")         # the gradients over dp, within a stage
    # a device holds its stage's two of the four layers (the stacked 64x64 query weights), and a
    # microbatch of one sequence of 16 tokens is what moves between stages
    assert "2x64x64xf32" in {str(t) for t in g.inputs}
    assert {str(op.operand_types[0]) for op in permutes} == {"1x16x64xf32"}


def test_an_interleaved_pipeline_goes_round_the_ring_once_per_chunk_with_a_shorter_bubble():
    # pp 2 with 2 chunks of one layer each: 4 microbatches go round twice, 2·4 + 2 - 1 = 9 ticks of one
    # layer each way, against GPipe's 4 + 2 - 1 = 5 ticks of two layers
    spec = f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1"
    gpipe, interleaved = load(spec), load(f"{spec}&schedule=interleaved:2")
    assert sorted(op.count for op in kinds(interleaved, "collective_permute")) == [9, 9]
    assert {str(op.operand_types[0]) for op in kinds(interleaved, "collective_permute")} == {"1x16x64xf32"}

    def layer_flops(g):        # the blocks' matrix products (the head's and the loss's are alike in both)
        return sum(op.count for op in kinds(g, "dot_general") if "64x64" in str(op.operand_types[1]))

    # each layer's matrix products run once per tick: 9 ticks of one layer against 5 ticks of two
    assert layer_flops(interleaved) * 10 == layer_flops(gpipe) * 9
    assert pipeline_bubble(parse_zoo_spec(spec)[1]) == pytest.approx(1 / 5)
    assert pipeline_bubble(parse_zoo_spec(f"{spec}&schedule=interleaved:2")[1]) == pytest.approx(1 / 9)


def test_a_tied_embedding_sums_its_gradient_over_the_stages_and_an_untied_one_does_not():
    pp_groups = ((0, 2), (1, 3))
    tied = load(f"{GPT}&mesh=pp:2,dp:2&devices=4&microbatch=2")
    untied = load(f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=2")
    assert pp_groups in groups_of(tied, "all_reduce")
    assert pp_groups not in groups_of(untied, "all_reduce")


def test_microbatches_without_a_pipeline_accumulate_gradients_before_one_all_reduce():
    whole = load(f"{LLAMA}&mesh=dp:2&devices=2")
    parts = load(f"{LLAMA}&mesh=dp:2&devices=2&microbatch=1")
    assert [lp.trip_count for lp in parts.loops] == [4] and not whole.loops
    assert sum(op.count for op in kinds(parts, "all_reduce")) == sum(op.count for op in kinds(whole, "all_reduce"))


def test_recomputation_trades_memory_for_work():
    spec = f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1"
    runs = {remat: simulate(f"{spec}&remat={remat}", target="H100", system="switch:4x450")
            for remat in ("none", "selective", "full")}
    assert runs["full"].peak_memory_bytes < runs["selective"].peak_memory_bytes <= runs["none"].peak_memory_bytes
    assert runs["full"].flops > runs["selective"].flops > runs["none"].flops    # the forward again, in part


def test_f32_master_weights_hold_parameters_gradients_and_optimizer_state_in_f32_and_compute_in_bf16():
    spec = f"{LLAMA}&dtype=bf16&optimizer=adam&mesh=dp:2,fsdp:2&devices=4"
    bf16, master = load(spec), load(f"{spec}&master=f32")
    def held(g, role):
        return {t.dtype for r, t in zip(g.input_roles, g.inputs) if r == role}

    assert held(bf16, "parameters") == {"bf16"} and held(bf16, "optimizer_state") == {"bf16", "i32"}
    assert held(master, "parameters") == {"f32"} and held(master, "optimizer_state") == {"f32", "i32"}
    for g in (bf16, master):                                                 # the matmuls run in bf16 alike
        assert {op.operand_types[0].dtype for op in kinds(g, "dot_general")} == {"bf16"}
    # FSDP gathers the bf16 copy (its gradient reduce-scattered in bf16); dp sums the f32 gradients
    assert {t.dtype for op in kinds(master, "all_gather") for t in op.result_types} == {"bf16"}
    assert {t.dtype for op in kinds(master, "reduce_scatter") for t in op.result_types} == {"bf16"}
    assert {t.dtype for op in kinds(master, "all_reduce") if op.result_types[0].shape for t in op.result_types} \
        == {"f32"}
    low, high = (split_program(g) for g in (bf16, master))
    from hespas_ml.split.memory import memory
    a, b = memory(low).argument_parts, memory(high).argument_parts
    assert b["parameters"] == 2 * a["parameters"] and b["optimizer_state"] == 2 * a["optimizer_state"] - 4


@pytest.mark.parametrize("bad, message", [
    ("&master=f32", "needs dtype=bf16 and step=train"),
    ("&dtype=bf16&step=infer&master=f32", "needs dtype=bf16 and step=train"),
    ("&dtype=bf16&master=f32&devices=2&parallel=dp-partitioned", "run on a mesh"),
])
def test_master_weights_need_a_bf16_training_step(bad, message):
    from hespas_ml.ingest.errors import IngestError
    with pytest.raises(IngestError, match=message):
        parse_zoo_spec(LLAMA.replace("&step=train", "") + bad)


ONE_F_ONE_B_CHECK = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from hespas_ml.ingest.zoo.parallel import Collectives
from hespas_ml.ingest.zoo.steps import LayeredModel, pipeline_1f1b_fn, pipeline_forward_fn

D, V, S, B, L = 8, 16, 4, 12, 4
sd = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
tokens_sd = jax.ShapeDtypeStruct((B, S), jnp.int32)
def embed(t, inputs, col):
    (tok,) = inputs
    return t["emb"][tok], None
def block(lp, x, ctx, col):
    return x + jnp.tanh(x @ lp["w"] + lp["b"])
def head(t, x, ctx, col):
    return x @ t["out"]
def loss(logits, targets, col):
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, targets[..., None], axis=-1))
model = LayeredModel(top={"emb": sd(V, D), "out": sd(D, V)}, layer={"w": sd(D, D), "b": sd(D)}, layers=L,
                     inputs=(tokens_sd,), targets=tokens_sd, embed=embed, block=block, head=head, loss=loss)
rng = np.random.default_rng(0)
params = {"top": {"emb": rng.normal(size=(V, D)).astype(np.float32), "out": rng.normal(size=(D, V)).astype(np.float32) / 3},
          "layers": {"w": rng.normal(size=(L, D, D)).astype(np.float32) / 3, "b": rng.normal(size=(L, D)).astype(np.float32)}}
tokens = rng.integers(0, V, size=(B, S)).astype(np.int32)
targets = rng.integers(0, V, size=(B, S)).astype(np.int32)

for stages, micro in ((2, 6), (4, 6), (4, 2)):
    mesh = jax.make_mesh((stages,), ("pp",), devices=jax.devices()[:stages])
    col = Collectives("mesh", stages, {}, mesh_axes={})
    specs = {"top": {"emb": P(), "out": P()}, "layers": {"w": P("pp"), "b": P("pp")}}
    gp = pipeline_forward_fn(model, stages=stages, microbatches=micro, scan=True, remat="full")
    def gpipe(prm, tok, tgt):
        def lf(q):
            l = gp(q, (tok,), col, tgt)
            return jnp.where(jax.lax.axis_index("pp") == stages - 1, l, 0.0)
        l, g = jax.value_and_grad(lf)(prm)
        return jax.lax.psum(l, "pp"), {"top": jax.lax.psum(g["top"], "pp"), "layers": g["layers"]}
    one = pipeline_1f1b_fn(model, stages=stages, microbatches=micro, col=col, loss_scale=1.0)
    def f1b(prm, tok, tgt):
        l, g = one(prm, (tok,), tgt)
        return jax.lax.psum(l, "pp"), {"top": jax.lax.psum(g["top"], "pp"), "layers": g["layers"]}
    from jax.sharding import NamedSharding
    placed = jax.device_put(params, jax.tree.map(lambda sp: NamedSharding(mesh, sp), specs,
                                                 is_leaf=lambda x: isinstance(x, P)))
    outs = []
    for fn in (gpipe, f1b):
        run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs), check_vma=False))
        outs.append(run(placed, tokens, targets))
    (l1, g1), (l2, g2) = outs
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
"""


def test_a_1f1b_pipeline_computes_gpipes_loss_and_gradients():
    """On 2 and 4 host devices, 2 to 6 microbatches (fewer than, as many as and more than the first stage
    keeps): the loss and every gradient of the lock-step 1F1B pipeline equal GPipe's under recomputation."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ONE_F_ONE_B_CHECK], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_1f1b_step_sends_as_gpipe_does_and_keeps_fewer_microbatches():
    """32 microbatches on 2 stages: each way M + P - 1 sends, as GPipe, but the first stage keeps the layer
    inputs of 3 microbatches, not of every tick's, so it needs less memory at its peak (attention fused, so
    the layer inputs are what a stage keeps), for about the work."""
    spec = ("zoo:llama?layers=4&d_model=256&heads=4&kv_heads=2&ffn=512&vocab=256&seq=1024&batch=64&step=train"
            "&remat=full&scan=true&attention=fused&mesh=pp:2,dp:2&devices=4&microbatch=1")
    runs = {s: simulate(f"{spec}&schedule={s}", target="H100", system="switch:4x450") for s in ("gpipe", "1f1b")}
    one = load(f"{spec}&schedule=1f1b")
    forward = {(0, 2), (2, 0), (1, 3), (3, 1)}
    sends = [op for op in kinds(one, "collective_permute")]
    assert all(set(map(tuple, op.attrs["source_target_pairs"])) == forward for op in sends)   # a ring of 2
    assert sum(op.count for op in sends) == 2 * (32 + 2 - 1)
    assert runs["1f1b"].peak_memory_bytes < 0.5 * runs["gpipe"].peak_memory_bytes
    assert runs["1f1b"].flops == pytest.approx(runs["gpipe"].flops, rel=0.03)
    assert pipeline_bubble(parse_zoo_spec(f"{spec}&schedule=1f1b")[1]) == pipeline_bubble(parse_zoo_spec(spec)[1])


def test_1f1b_needs_recomputation_and_means_nothing_without_a_pipeline():
    from hespas_ml.ingest.errors import IngestError
    with pytest.raises(IngestError, match="give remat=full"):
        parse_zoo_spec(LLAMA + "&mesh=pp:2&devices=2&microbatch=1&schedule=1f1b")
    # a layout search gives every mesh the same schedule: without pp it is plain data parallelism
    assert pipeline_bubble(parse_zoo_spec(LLAMA + "&mesh=dp:2&devices=2&schedule=1f1b")[1]) == 0.0


@pytest.mark.parametrize("spec, system", [
    (f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1", "switch:4x450"),
    (f"{LLAMA}&mesh=pp:4,tp:2&devices=8&microbatch=2&scan=true&remat=full", "switch:2x450,switch:4x50"),
    (f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1&scan=true&schedule=interleaved:2", "switch:2x450,switch:2x50"),
    (f"{LLAMA}&mesh=pp:4&devices=4&microbatch=1&scan=true&remat=full&schedule=1f1b", "switch:2x450,switch:2x50"),
    (GPT.replace("step=train", "step=infer") + "&mesh=pp:2,fsdp:2&devices=4&microbatch=2", "switch:2x450,switch:2x50"),
])
def test_a_pipeline_replays_rank_zero_alone_to_the_nanosecond(spec, system):
    rg = split_program(load(spec))
    traces = build_traces(rg, [r.flops * 1e-15 + 2e-6 for r in rg.regions])
    assert traces.replay_plan() is not None and not isinstance(traces.replay_plan(), str)
    cfg = load_system(system)
    fast = replay_fast(traces.traces, cfg, traces.comm_groups, traces.replay_plan())
    every_rank = replay_embedded(traces.traces, cfg, traces.comm_groups)
    assert fast.details["engine"] == "fast" and every_rank.details["engine"] == "full"
    assert fast.ranks == every_rank.ranks


SEQUENCE_PARALLEL_CHECK = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from hespas_ml.ingest.zoo import transformer as tf
from hespas_ml.ingest.zoo.parallel import Collectives

V, D, F, B, S, T = 64, 8, 16, 2, 8, 4
k = jax.random.split(jax.random.PRNGKey(0), 6)
params = {"embed": jax.random.normal(k[0], (V, D)), "pos": jax.random.normal(k[1], (S, D)),
          "norm": 1 + 0.1 * jax.random.normal(k[2], (D,)), "w1": jax.random.normal(k[3], (D, F)) / 3,
          "w2": jax.random.normal(k[4], (F, D)) / 4, "head": jax.random.normal(k[5], (D, V))}
tokens = jax.random.randint(k[0], (B, S), 0, V)
targets = (tokens * 7 + 3) % V
mesh = Mesh(np.array(jax.devices()[:T]), ("tp",))
split = {"embed": P("tp", None), "pos": P(), "norm": P(), "w1": P(None, "tp"), "w2": P("tp", None),
         "head": P(None, "tp")}

def loss(p, col):
    x = tf.vocab_embed(p["embed"], tokens, col) + col.seq_shard(p["pos"][None])
    h = col.enter_tp(tf.rms_norm(x, p["norm"]))
    x = x + col.exit_tp(jnp.tanh(h @ p["w1"]) @ p["w2"])
    return tf.vocab_loss(tf.vocab_head(tf.rms_norm(x, p["norm"]), p["head"], col), targets, col)

def run(sequence_parallel):
    col = Collectives("mesh", T, mesh_axes={"tp": "tp"}, sequence_parallel=sequence_parallel)
    def step(p):
        value, grads = jax.value_and_grad(loss)(p, col)
        if sequence_parallel:          # replicated weights saw a part of the sequence each (as the export sums)
            grads = {n: jax.lax.psum(g, "tp") if split[n] == P() else g for n, g in grads.items()}
        return value, grads
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(split,), out_specs=(P(), split), check_vma=False))(params)

(l1, g1), (l2, g2) = run(False), run(True)
np.testing.assert_allclose(l1, l2, rtol=1e-5)
for n in params:
    np.testing.assert_allclose(g1[n], g2[n], rtol=1e-4, atol=1e-6, err_msg=n)
"""


def test_sequence_parallelism_computes_the_same_loss_and_gradients():
    """On 4 host devices: with the activations split along the sequence between the tensor-parallel
    regions (all-gather in, reduce-scatter out), the loss and every gradient equal tp without it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SEQUENCE_PARALLEL_CHECK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_sequence_parallel_steps_move_a_part_of_the_sequence_between_tp_regions():
    """sp=true: every tp all-reduce of activations becomes a reduce-scatter out of the region and an
    all-gather into the next, a pipeline passes a quarter of each sequence, the norms' gradients are summed
    over tp, and a device holds less at the peak."""
    spec = f"{LLAMA.replace('kv_heads=2', 'kv_heads=4')}&mesh=pp:2,tp:4&devices=8&microbatch=2"
    plain, sp = load(spec), load(f"{spec}&sp=true")
    assert not kinds(plain, "reduce_scatter") and not kinds(plain, "all_gather")
    scatters, gathers = kinds(sp, "reduce_scatter"), kinds(sp, "all_gather")
    assert scatters and gathers and {str(op.result_types[0]) for op in scatters} == {"2x4x64xf32"}
    assert {str(op.operand_types[0]) for op in kinds(sp, "collective_permute")} == {"2x4x64xf32"}
    tp_groups = ((0, 1, 2, 3), (4, 5, 6, 7))
    norms = [op for op in kinds(sp, "all_reduce") if str(op.operand_types[0]) in ("2x64xf32", "64xf32")]
    assert norms and all(tp_groups == tuple(map(tuple, op.attrs["replica_groups"])) for op in norms)
    runs = {s: simulate(f"{spec}{s}", target="H100", system="switch:8x450") for s in ("", "&sp=true")}
    assert runs["&sp=true"].peak_memory_bytes < runs[""].peak_memory_bytes


CONTEXT_PARALLEL_CHECK = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from hespas_ml.ingest.zoo import transformer as tf
from hespas_ml.ingest.zoo.parallel import Collectives

V, D, H, KV, B, S = 64, 16, 4, 2, 2, 8
shapes = tf.decoder_attention_shapes(D, H, KV, jnp.float32)
keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
params = {n: 0.3 * jax.random.normal(next(keys), s.shape) for n, s in shapes.items()}
params["attn_norm"] = 1 + params["attn_norm"]
params.update(embed=jax.random.normal(next(keys), (V, D)), head=jax.random.normal(next(keys), (D, V)) / 4)
tokens = jax.random.randint(next(keys), (B, S), 0, V)
targets = (tokens * 7 + 3) % V
tp_split = {"wq": P(None, "tp"), "wk": P(None, "tp"), "wv": P(None, "tp"), "wo": P("tp", None),
            "embed": P("tp", None), "head": P(None, "tp")}

def loss(p, tok, tgt, col):
    x = tf.vocab_embed(p["embed"], tok, col)
    rope = tuple(col.cp_shard(a, axis=0) for a in tf.rope_tables(S, D // H, jnp.float32))
    x = tf.decoder_attention(p, x, D // H, rope, col)
    return tf.vocab_loss(tf.vocab_head(x, p["head"], col), tgt, col)

def run(axes, sp):
    names = tuple(axes)
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(list(axes.values())))]).reshape(tuple(axes.values())), names)
    col = Collectives("mesh", 4, mesh_axes={a: a for a in names}, sequence_parallel=sp)
    split = {n: (tp_split.get(n, P()) if "tp" in names else P()) for n in params}
    seq = P(None, "cp") if "cp" in names else P()
    def step(p, tok, tgt):
        value, grads = jax.value_and_grad(loss)(p, tok, tgt, col)
        if "cp" in names:             # each device's mean over its part: one mean, its gradient summed
            value = jax.lax.psum(value, "cp") / axes["cp"]
            grads = jax.tree.map(lambda g: jax.lax.psum(g, "cp") / axes["cp"], grads)
        if sp:
            grads = {n: jax.lax.psum(g, "tp") if split[n] == P() else g for n, g in grads.items()}
        return value, grads
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(split, seq, seq), out_specs=(P(), split),
                                 check_vma=False))(params, tokens, targets)

want = run({"one": 1}, False)
for axes, sp in (({"cp": 2}, False), ({"cp": 4}, False), ({"cp": 2, "tp": 2}, False), ({"cp": 2, "tp": 2}, True)):
    got = run(axes, sp)
    np.testing.assert_allclose(want[0], got[0], rtol=1e-5, err_msg=str(axes))
    for n in params:
        np.testing.assert_allclose(want[1][n], got[1][n], rtol=1e-4, atol=1e-5, err_msg=f"{axes} {sp} {n}")
"""


def test_context_parallelism_computes_the_same_loss_and_gradients():
    """On 4 host devices: with the sequence split over cp (each device its queries, the keys and values of
    the whole sequence gathered, the causal mask at its place), alone or with tp and sp, the loss and every
    gradient equal one device's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CONTEXT_PARALLEL_CHECK], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_context_parallel_step_gathers_keys_and_values_over_cp():
    """mesh=dp:2,cp:2: a device holds half the batch's half of each sequence, every layer all-gathers its
    keys and values over its cp pair (and reduce-scatters their gradients back), and the gradients are
    summed over dp and cp at once."""
    g = load(f"{LLAMA}&mesh=dp:2,cp:2&devices=4")
    assert "4x8xi32" in {str(t) for t in g.inputs}                   # 8 sequences of 16 over dp 2, cp 2
    gathers = kinds(g, "all_gather")
    cp_pairs = ((0, 1), (2, 3))
    assert len(gathers) == 2 * 4 and all(tuple(map(tuple, op.attrs["replica_groups"])) == cp_pairs
                                         for op in gathers)              # keys and values, 4 layers
    assert {str(op.result_types[0]) for op in gathers} == {"4x16x2x16xf32"}
    assert len(kinds(g, "reduce_scatter")) == 2 * 4
    assert ((0, 1, 2, 3),) in groups_of(g, "all_reduce")                 # gradients over dp and cp
    res = simulate(f"{LLAMA}&mesh=dp:2,cp:2&devices=4", target="H100", system="switch:4x450")
    assert res.step_time_s > 0 and res.fits


def test_fused_attention_is_one_kernel_each_way_priced_as_flash_attention():
    """attention=fused: each layer's attention is one custom call forward and one backward, which the cost
    model prices (half of the causal score matrix, operands read and results written once); no score matrix
    is kept for backward, so a device holds less."""
    from hespas_ml.costs import op_cost
    from hespas_ml.ingest.graph import FUSED_ATTENTION, FUSED_ATTENTION_GRAD

    spec = f"{LLAMA}&mesh=dp:2,cp:2&devices=4"
    g = load(f"{spec}&attention=fused")
    calls = kinds(g, "custom_call")
    assert sorted(op.attrs["call_target_name"] for op in calls) == [FUSED_ATTENTION] * 4 + [FUSED_ATTENTION_GRAD] * 4
    forward = next(op for op in calls if op.attrs["call_target_name"] == FUSED_ATTENTION)
    # 4 sequences' halves of 8 queries against all 16 keys, 4 heads of 16: 2·b·h·s·t·d
    cost = op_cost(forward)
    assert cost.modelled and cost.flops == 2 * 4 * 4 * 8 * 16 * 16 and cost.unit == "matrix"
    assert cost.bytes == sum(t.nbytes for t in forward.operand_types) + forward.result_types[0].nbytes
    assert not kinds(g, "reduce") or all("16x16" not in str(op.operand_types[0]) for op in kinds(g, "reduce"))
    runs = {a: simulate(f"{spec}&attention={a}", target="H100", system="switch:4x450") for a in ("unfused", "fused")}
    assert runs["fused"].peak_memory_bytes < runs["unfused"].peak_memory_bytes
    assert not runs["fused"].unmodelled
