"""The op ABI, pinned: every schema string we define and what the dispatcher registered.

A change here is a change of the ``moonep`` ops' ABI (vLLM graphs and saved AOT artifacts
refer to them by schema): update the expected text on purpose, never by reflex
(``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_schemas.py`` rewrites it).
"""

import unittest

import expecttest
import torch

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops.schemas import NAMESPACE, SCHEMAS, op


def _registered_schema(name: str) -> str:
    return str(op(name)._schema)


class TestSchemas(expecttest.TestCase):
    def test_namespace(self):
        self.assertExpectedInline(NAMESPACE, """moonep""")

    def test_defined_schemas(self):
        # One line per op, in definition order: a new, renamed or changed op shows up here.
        self.assertExpectedInline("\n".join(SCHEMAS.values()), """\
grouped_gemm(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor
grouped_gemm_out(Tensor a, Tensor w, Tensor cu_seqlens, Tensor(a!) out) -> ()
silu_mul_weight(Tensor gate, Tensor up, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
grouped_gemm_silu_mul(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
grouped_gemm_silu_mul_with_gate_up(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor act, Tensor gate, Tensor up)
experts(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
experts_out(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, Tensor cu_seqlens, Tensor(a!) out) -> ()
grouped_gemm_fp8(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens) -> Tensor
grouped_gemm_fp8_out(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens, Tensor(a!) out) -> ()
experts_fp8(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
experts_fp8_out(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens, Tensor(a!) out) -> ()
grouped_gemm_dgrad(Tensor grad_out, Tensor w, Tensor cu_seqlens) -> Tensor
grouped_gemm_dual_dgrad(Tensor grad_gate, Tensor grad_up, Tensor w_gate, Tensor w_up, Tensor cu_seqlens) -> Tensor
grouped_gemm_wgrad(Tensor grad_out, Tensor a, Tensor cu_seqlens) -> Tensor
silu_mul_weight_backward(Tensor grad, Tensor gate, Tensor up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)
grouped_gemm_silu_mul_backward(Tensor grad, Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)""")

    def test_registered_schemas(self):
        # What the dispatcher parsed, which is what graphs and opcheck see.
        self.assertExpectedInline("\n".join(_registered_schema(name) for name in SCHEMAS), """\
moonep::grouped_gemm(Tensor a, Tensor w, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_out(Tensor a, Tensor w, Tensor cu_seqlens, Tensor(a!) out) -> ()
moonep::silu_mul_weight(Tensor gate, Tensor up, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_silu_mul(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_silu_mul_with_gate_up(Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor act, Tensor gate, Tensor up)
moonep::experts(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
moonep::experts_out(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? route_weights, Tensor cu_seqlens, Tensor(a!) out) -> ()
moonep::grouped_gemm_fp8(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_fp8_out(Tensor a, Tensor w, Tensor w_scale, Tensor cu_seqlens, Tensor(a!) out) -> ()
moonep::experts_fp8(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens) -> Tensor
moonep::experts_fp8_out(Tensor x, Tensor w_gate, Tensor w_gate_scale, Tensor w_up, Tensor w_up_scale, Tensor w_down, Tensor w_down_scale, Tensor? route_weights, Tensor cu_seqlens, Tensor(a!) out) -> ()
moonep::grouped_gemm_dgrad(Tensor grad_out, Tensor w, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_dual_dgrad(Tensor grad_gate, Tensor grad_up, Tensor w_gate, Tensor w_up, Tensor cu_seqlens) -> Tensor
moonep::grouped_gemm_wgrad(Tensor grad_out, Tensor a, Tensor cu_seqlens) -> Tensor
moonep::silu_mul_weight_backward(Tensor grad, Tensor gate, Tensor up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)
moonep::grouped_gemm_silu_mul_backward(Tensor grad, Tensor x, Tensor w_gate, Tensor w_up, Tensor? route_weights, Tensor cu_seqlens) -> (Tensor, Tensor, Tensor)""")

    def test_every_defined_schema_is_the_registered_one(self):
        for name, schema in SCHEMAS.items():
            self.assertEqual(_registered_schema(name), f"{NAMESPACE}::{schema}")

    def test_only_the_out_variants_mutate(self):
        # Functionalization and CUDA-graph trees rely on the alias annotations being right.
        mutating = [name for name in SCHEMAS
                    if any(arg.alias_info is not None and arg.alias_info.is_write
                           for arg in op(name)._schema.arguments)]
        self.assertExpectedInline(repr(mutating), """['grouped_gemm_out', 'experts_out', 'grouped_gemm_fp8_out', 'experts_fp8_out']""")
        for name in mutating:
            written = [arg.name for arg in op(name)._schema.arguments
                       if arg.alias_info is not None and arg.alias_info.is_write]
            self.assertEqual(written, ["out"], name)

    def test_cpu_kernel_and_fake_registered(self):
        # A CPU kernel for CI, a fake (Meta) impl for tracing and the autocast rules, for every op.
        for name in SCHEMAS:
            qualname = f"{NAMESPACE}::{name}"
            for key in ("CPU", "Meta", "AutocastCPU", "AutocastCUDA"):
                self.assertTrue(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key),
                                f"{qualname} has no {key} kernel")

    def test_every_op_is_tagged_pt2_compliant(self):
        # (each passes opcheck: tests/test_opcheck.py, tests/test_autograd.py)
        self.assertEqual([name for name in SCHEMAS if torch.Tag.pt2_compliant_tag not in op(name).tags], [])


if __name__ == "__main__":
    unittest.main()
