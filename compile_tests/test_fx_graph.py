"""The graphs torch.compile traces for the experts, pinned with expecttest.

They show what Dynamo and AOTAutograd see: the ``moonep`` ops, one node each, no fallbacks, no
graph break. The graphs are rendered by :func:`render` (canonical names, one node per line) rather
than ``gm.code``, whose variable names and ``= None`` bookkeeping change between torch releases.
Update with ``EXPECTTEST_ACCEPT=1 python -m pytest compile_tests/test_fx_graph.py``.
"""

import re

import torch
from expecttest import TestCase
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch.fx.node import _get_qualified_name

from .cases import GROUPED_MM_CPU, IMPLS, experts_inputs
from .moe import MoEShape

SHAPE = MoEShape()


def render(gm: torch.fx.GraphModule, input_names=None) -> str:
    """One line per node: ``name = target(args)``; inputs named after the Python arguments."""
    names, lines, count = {}, [], 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if input_names is None:  # Dynamo names inputs L_<arg>_
        input_names = [re.sub(r"^L_(.*)_$", r"\1", n.target) for n in placeholders]
    for node, name in zip(placeholders, input_names):
        names[node] = name

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, list):
            return "[" + ", ".join(arg(b) for b in a) + "]"
        if isinstance(a, tuple):
            return "(" + ", ".join(arg(b) for b in a) + (",)" if len(a) == 1 else ")")
        return str(a)

    def call(args, kwargs):
        return ", ".join([arg(a) for a in args] + [f"{k}={arg(v)}" for k, v in kwargs.items()])

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"return {arg(node.args[0])}")
            continue
        names[node] = f"t{count}"
        count += 1
        if node.op == "call_function":
            target = str(node.target) if isinstance(node.target, torch._ops.OpOverload) \
                else _get_qualified_name(node.target)
            lines.append(f"{names[node]} = {target}({call(node.args, node.kwargs)})")
        elif node.op == "call_method":
            self_, *rest = node.args
            lines.append(f"{names[node]} = {arg(self_)}.{node.target}({call(rest, node.kwargs)})")
        else:
            lines.append(f"{names[node]} = {node.op} {node.target}")
    return "\n".join(lines)


class TracedGraphs(TestCase):
    def setUp(self):
        torch._dynamo.reset()
        counters.clear()

    def tearDown(self):
        torch._dynamo.reset()

    def _dynamo_graph(self, fn, *args):
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm

        torch.compile(fn, backend=capture, fullgraph=True)(*args)
        self.assertEqual(len(graphs), 1)
        self.assertEqual(dict(counters["graph_break"]), {})
        return graphs[0]

    def _aot_graph(self, fn, *args):
        """The forward graph AOTAutograd hands to the backend compiler (aten level)."""
        dynamo, forward = [], []

        def fw(gm, example_inputs):
            forward.append(gm)
            return gm

        inner = aot_autograd(fw_compiler=fw)

        def capture(gm, example_inputs):
            dynamo.append(gm)
            return inner(gm, example_inputs)

        torch.compile(fn, backend=capture, fullgraph=True)(*args)
        self.assertEqual(len(forward), 1)
        inputs = [re.sub(r"^L_(.*)_$", r"\1", n.target) for n in dynamo[0].graph.nodes
                  if n.op == "placeholder"]
        return forward[0], inputs

    def test_moonep_experts_dynamo(self):
        gm = self._dynamo_graph(IMPLS["moonep"], *experts_inputs(SHAPE, torch.bfloat16))
        self.assertExpectedInline(render(gm), """\
t0 = moonep.experts.default(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
return (t0,)""")

    def test_moonep_experts_no_route_weights_dynamo(self):
        inputs = experts_inputs(SHAPE, torch.bfloat16)[:-1]
        gm = self._dynamo_graph(IMPLS["moonep"], *inputs)
        self.assertExpectedInline(render(gm), """\
t0 = moonep.experts.default(x, w_gate, w_up, w_down, None, cu_seqlens)
return (t0,)""")

    def test_moonep_experts_out_dynamo(self):
        inputs = experts_inputs(SHAPE, torch.bfloat16)

        def experts_into(x, w_gate, w_up, w_down, cu_seqlens, route_weights, out):
            return IMPLS["moonep"](x, w_gate, w_up, w_down, cu_seqlens, route_weights, out=out)

        gm = self._dynamo_graph(experts_into, *inputs, torch.empty_like(inputs[0]))
        self.assertExpectedInline(render(gm), """\
t0 = moonep.experts_out.default(x, w_gate, w_up, w_down, route_weights, cu_seqlens, out)
return (out,)""")

    def test_moonep_experts_aot(self):
        gm, inputs = self._aot_graph(IMPLS["moonep"], *experts_inputs(SHAPE, torch.bfloat16))
        # Only moonep ops at the aten level: nothing was decomposed or replaced by a fallback.
        targets = {str(n.target).split(".")[0] for n in gm.graph.nodes if n.op == "call_function"}
        self.assertEqual(targets, {"moonep"})
        self.assertExpectedInline(render(gm, inputs), """\
t0 = moonep.experts.default(x, w_gate, w_up, w_down, route_weights, cu_seqlens)
return (t0,)""")

    def test_grouped_mm_composition_dynamo(self):
        if not GROUPED_MM_CPU:
            self.skipTest("no torch._grouped_mm on CPU")
        gm = self._dynamo_graph(IMPLS["grouped_mm"], *experts_inputs(SHAPE, torch.bfloat16))
        self.assertExpectedInline(render(gm), """\
t0 = w_gate.transpose(1, 2)
t1 = torch._grouped_mm(x, t0, offs=cu_seqlens)
t2 = w_up.transpose(1, 2)
t3 = torch._grouped_mm(x, t2, offs=cu_seqlens)
t4 = torch.nn.functional.silu(t1)
t5 = t4.mul_(t3)
t6 = route_weights.to(torch.bfloat16)
t7 = t6.unsqueeze(-1)
t8 = t4.mul_(t7)
t9 = w_down.transpose(1, 2)
t10 = torch._grouped_mm(t4, t9, offs=cu_seqlens)
return (t10,)""")
