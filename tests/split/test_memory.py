"""Per-device memory of a split program: by hand on a small chain, and against XLA's own buffer assignment."""
from __future__ import annotations

import pytest

from hespas_ml.ingest import parse_module
from hespas_ml.split.memory import memory
from hespas_ml.split.regions import split_program

KIB256 = 256 * 256 * 4          # one tensor<256x256xf32>

CHAIN = """
func.func @main(%a: tensor<256x256xf32>) -> tensor<256x256xf32> {
  %0 = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
  %1 = stablehlo.add %0, %a : tensor<256x256xf32>
  %2 = stablehlo.multiply %1, %0 : tensor<256x256xf32>
  %3 = stablehlo.tanh %2 : tensor<256x256xf32>
  return %3 : tensor<256x256xf32>
}
"""


def test_a_chain_by_hand_one_kernel_per_op():
    # dot -> %0; add -> %1 (reads %0); multiply -> %2 while it reads %1 and %0: three live, the peak;
    # tanh -> %3 (returned) while it reads %2: two
    m = memory(split_program(parse_module(CHAIN), "individual"))
    assert (m.arguments, m.intermediates, m.collective_buffers, m.outputs) == (KIB256, 3 * KIB256, 0, 0)
    assert m.peak == 4 * KIB256 and m.to_dict()["peak"] == m.peak


def test_values_a_fused_kernel_keeps_on_chip_take_no_device_memory():
    unfused = memory(split_program(parse_module(CHAIN), "individual"))
    fused = memory(split_program(parse_module(CHAIN), "fusion"))
    assert fused.arguments == unfused.arguments and fused.peak < unfused.peak


def test_collective_results_are_counted_as_buffers():
    text = """
func.func @main(%a: tensor<1024xf32>) -> tensor<1024xf32> {
  %0 = stablehlo.multiply %a, %a : tensor<1024xf32>
  %1 = "stablehlo.all_reduce"(%0) ({
    ^bb0(%x: tensor<f32>, %y: tensor<f32>):
      %s = stablehlo.add %x, %y : tensor<f32>
      stablehlo.return %s : tensor<f32>
  }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<1024xf32>) -> tensor<1024xf32>
  %2 = stablehlo.add %1, %0 : tensor<1024xf32>
  %3 = stablehlo.multiply %2, %2 : tensor<1024xf32>
  return %3 : tensor<1024xf32>
}
"""
    # the peak is the add: it reads the all-reduce's buffer and %0 and writes %2
    m = memory(split_program(parse_module(text), "individual"))
    assert (m.arguments, m.intermediates, m.collective_buffers, m.outputs) == (4096, 8192, 4096, 0)


@pytest.mark.parametrize("program", [
    "zoo:mlp?layers=4&width=1024&batch=256&step=train",
    "zoo:llama?layers=2&d_model=256&heads=4&vocab=1024&seq=128&batch=4&step=train",
])
@pytest.mark.slow
def test_the_peak_is_near_what_xla_assigns(program):
    """Within a factor of 1.6 of XLA:CPU's arguments + outputs + temporaries for the same program."""
    import jax
    from jax._src.lib import xla_client

    from hespas_ml.ingest import load_program
    from hespas_ml.ingest.zoo import zoo_program

    ours = memory(split_program(load_program(program), "fusion"))
    device = jax.devices("cpu")[0]
    stats = device.client.compile_and_load(zoo_program(program), [device],
                                           xla_client.CompileOptions()).get_compiled_memory_stats()
    assert ours.arguments == stats.argument_size_in_bytes
    xla = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    assert xla / 1.6 <= ours.peak <= xla * 1.6, (ours.peak, xla)


@pytest.mark.slow
def test_arguments_are_what_one_device_holds():
    """A sharded program's arguments count at the shapes one device holds (the shard_map body's), not the
    global ones its main function is written with."""
    from hespas_ml.ingest import load_program

    llama = "zoo:llama?layers=2&d_model=128&heads=4&vocab=512&seq=64&batch=8&step=train"
    single = memory(split_program(load_program(llama), "fusion")).arguments
    dp = memory(split_program(load_program(f"{llama}&parallel=dp&devices=4"), "fusion")).arguments
    tp = memory(split_program(load_program(f"{llama}&parallel=tp&devices=4"), "fusion")).arguments
    tokens = 8 * 64 * 4 * 2                       # inputs and targets, i32
    assert dp == single - tokens * 3 // 4          # the same parameters, a quarter of the batch
    assert single / 4 < tp < single / 2           # attention and MLP split four ways, embeddings whole


@pytest.mark.slow
def test_a_zoo_steps_arguments_are_split_into_what_they_hold():
    """Parameters, optimizer state and batch, from the roles the zoo writes into the module; a program that
    says nothing has only its arguments."""
    from hespas_ml.ingest import load_program
    from hespas_ml.ingest.zoo import llama, parse_zoo_spec

    spec = "zoo:llama?layers=2&d_model=128&heads=4&vocab=512&seq=64&batch=8&step=train&optimizer=adam"
    m = memory(split_program(load_program(spec), "fusion"))
    params = llama.parameter_count(parse_zoo_spec(spec)[1]) * 4
    assert m.argument_parts == {"parameters": params, "optimizer_state": 2 * params + 4, "batch": 2 * 8 * 64 * 4}
    assert sum(m.argument_parts.values()) == m.arguments and m.to_dict()["parameters"] == params
    sharded = memory(split_program(load_program(f"{spec}&mesh=dp:2,tp:2&devices=4"), "fusion"))
    assert sharded.argument_parts["batch"] == 2 * 4 * 64 * 4                    # half the batch per device
    assert params / 2 < sharded.argument_parts["parameters"] < params           # attention and MLP halved
    assert memory(split_program(parse_module(CHAIN), "fusion")).argument_parts == {}
