"""The step-time breakdown's bookkeeping on a hand-written HLO module and profile: which part
of a step every instruction belongs to, and milliseconds per step by part."""

import pytest

from benchmarks import breakdown as bd

STACK = "jit(_train_step)/jvp()/shard_map/"


def line(name, type_, opcode, operands, op_name=None, root=False):
  """One HLO instruction line, as XLA prints it."""
  meta = "" if op_name is None else f', metadata={{op_name="{op_name}"}}'
  return f"  {'ROOT ' if root else ''}%{name} = {type_} {opcode}({operands}){meta}"


HLO = "\n".join([
    "HloModule jit__train_step, entry_computation_layout={(f32[4]{0})->f32[]}", "",
    "%branch_0 (p: f32[4]) -> f32[4] {",
    line("p", "f32[4]{0}", "parameter", "0"),
    line("ynn_fusion.3", "f32[4]{0}", "fusion", "%p",
         STACK + "tp_block/cond/branch_0_fun/dot_general", root=True),
    "}", "", "ENTRY %main (a: f32[4]) -> f32[] {",
    line("a", "f32[4]{0}", "parameter", "0"),
    line("cond.1", "(f32[4]{0}, s32[])", "conditional", "%i, %a, %a", STACK + "tp_block/cond"),
    line("psum_invariant.7", "f32[16,64,256]{2,1,0}", "all-reduce", "%x",
         STACK + "psum_invariant"),
    line("dot.61", "f32[256,256]{1,0}", "dot", "%h, %g",
         "jit(_train_step)/transpose(jvp())/shard_map/transpose"),
    line("multiply_add_fusion.3", "f32[256]{0}", "fusion", "%w, %u", "jit(_train_step)/add"),
    line("copy.5", "f32[4]{0}", "copy", "%a"),
    line("r", "f32[]", "reduce", "%a", STACK + "_terms/reduce", root=True), "}"])


def test_instructions_read_opcodes_and_name_stacks_of_every_computation():
  got = bd.instructions(HLO)
  assert got["ynn_fusion.3"] == (
      "fusion", "jit(_train_step)/jvp()/shard_map/tp_block/cond/branch_0_fun/dot_general")
  assert got["cond.1"][0] == "conditional"          # a tuple type is skipped
  assert got["psum_invariant.7"][0] == "all-reduce"
  assert got["copy.5"] == ("copy", "")
  assert got["r"][0] == "reduce" and got["p"][0] == "parameter"


def test_categories_and_parts_per_step():
  hlo = bd.instructions(HLO)
  cats = {name: bd.category(*v) for name, v in hlo.items()}
  assert cats["ynn_fusion.3"] == "blocks" and cats["cond.1"] is None   # a container
  assert cats["psum_invariant.7"] == "collectives"
  assert cats["dot.61"] == "repeated" and cats["r"] == "repeated"
  assert cats["multiply_add_fusion.3"] == "optimizer"      # after the gradients
  assert cats["copy.5"] == "other" and cats["p"] is None
  # 2 profiled steps (microseconds per event name); events of other programs are left out.
  times = {"ynn_fusion.3": 4000.0, "cond.1": 4500.0, "psum_invariant.7": 1000.0,
           "dot.61": 600.0, "multiply_add_fusion.3": 200.0, "copy.5": 100.0,
           "PjitFunction(step)": 9000.0}
  parts = bd.parts(times, hlo, steps=2)
  assert parts == pytest.approx({"blocks": 2.0, "repeated": 0.3, "optimizer": 0.1,
                                 "collectives": 0.5, "other": 0.05})
  top = bd.top_ops(times, hlo, steps=2)
  assert top["blocks"][0][:3] == [2.0, "ynn_fusion.3", "fusion"]


def test_branched_cost_and_table():
  r = lambda wall, cpu, steal=0.25: {"wall_ms": wall, "cpu_ms": cpu, "unattributed_ms": 2.0,
                                      "parts_ms": dict.fromkeys(bd.PARTS, 1.0),
                                      "mlp_counts": [768, 256], "host_steal": steal}
  merged = bd.merge([{"none": {"oracle": r(110.0, 100.0), "oracle_single": r(100.0, 98.0)}},
                     {"none": {"oracle": r(111.0, 60.0), "oracle_single": r(101.0, 99.0, None)}}])
  cost = bd.branched_cost(merged)["none"]
  assert cost == pytest.approx({"wall": 1.1, "cpu": 100 / 98})
  table = bd.markdown(merged)
  assert ("| none | oracle (768/256) | 1 | 111.0 | 60.0 | 1.0 | 1.0 | 1.0 | 1.0 | 1.0 | 2.0 | 25% |"
          in table)
  last = table.splitlines()[-1]                 # process 1 of oracle_single: no steal figure
  assert last.startswith("| none | oracle_single (768/256) | 1 | 101.0 |")
  assert last.endswith("| 2.0 | – |")
