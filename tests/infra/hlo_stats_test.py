"""`hlo_stats` on HLO text written by hand (every byte counted here by hand) and on programs
XLA:CPU compiles (the same text format the GPU and TPU compilers print:
tests/training/aot_hlo_test.py reads theirs)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from absl.testing import absltest

from mmr_jax.infra import hlo_stats

jax.config.update("jax_numpy_rank_promotion", "raise")

# A module with a 3-trip loop whose body updates a [3, 8, 16] f32 buffer in place, one row
# [1, 8, 16] at a time; before the loop a transpose fusion and a two-output fusion (a pad and a
# multiply); after it a copy, and a custom call.
_TEXT = """HloModule jit_f, is_scheduled=true, input_output_alias={ {0}: (1, {}, may-alias) }

%fused_transpose (param_0: f32[16,8]) -> f32[8,16] {
  %param_0 = f32[16,8]{1,0} parameter(0)
  ROOT %transpose.1 = f32[8,16]{1,0} transpose(%param_0), dimensions={1,0}
}

%fused_two (param_0.1: f32[8,16]) -> (f32[8,32], bf16[8,16]) {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  %constant.2 = f32[] constant(0)
  %pad.3 = f32[8,32]{1,0} pad(%param_0.1, %constant.2), padding=0_0x0_16
  %convert.4 = bf16[8,16]{1,0} convert(%param_0.1)
  %multiply.5 = bf16[8,16]{1,0} multiply(%convert.4, %convert.4)
  %bitcast.6 = bf16[8,16]{1,0} bitcast(%multiply.5)
  ROOT %tuple.7 = (f32[8,32]{1,0}, bf16[8,16]{1,0}) tuple(%pad.3, %bitcast.6)
}

%fused_update (param_0.2: f32[3,8,16], param_1.2: f32[8,16], param_2.2: s32[]) -> f32[3,8,16] {
  %param_0.2 = f32[3,8,16]{2,1,0} parameter(0)
  %param_1.2 = f32[8,16]{1,0} parameter(1)
  %bitcast.8 = f32[1,8,16]{2,1,0} bitcast(%param_1.2)
  %param_2.2 = s32[] parameter(2)
  %constant.9 = s32[] constant(0)
  ROOT %dynamic-update-slice.10 = f32[3,8,16]{2,1,0} dynamic-update-slice(%param_0.2, %bitcast.8, %param_2.2, %constant.9, %constant.9)
}

%body (p.11: (s32[], f32[3,8,16], f32[8,16])) -> (s32[], f32[3,8,16], f32[8,16]) {
  %p.11 = (s32[], f32[3,8,16]{2,1,0}, f32[8,16]{1,0}) parameter(0)
  %i.12 = s32[] get-tuple-element(%p.11), index=0
  %buf.13 = f32[3,8,16]{2,1,0} get-tuple-element(%p.11), index=1
  %x.14 = f32[8,16]{1,0} get-tuple-element(%p.11), index=2
  %update.15 = f32[3,8,16]{2,1,0} fusion(%buf.13, %x.14, %i.12), kind=kLoop, calls=%fused_update
  %one.16 = s32[] constant(1)
  %next.17 = s32[] add(%i.12, %one.16)
  ROOT %tuple.18 = (s32[], f32[3,8,16]{2,1,0}, f32[8,16]{1,0}) tuple(%next.17, %update.15, %x.14)
}

%cond (p.19: (s32[], f32[3,8,16], f32[8,16])) -> pred[] {
  %p.19 = (s32[], f32[3,8,16]{2,1,0}, f32[8,16]{1,0}) parameter(0)
  %i.20 = s32[] get-tuple-element(%p.19), index=0
  %three.21 = s32[] constant(3)
  ROOT %lt.22 = pred[] compare(%i.20, %three.21), direction=LT
}

ENTRY %main (x: f32[16,8], buf: f32[3,8,16]) -> (f32[3,8,16], f32[8,32], bf16[8,16], f32[3,8,16], f32[4]) {
  %x = f32[16,8]{1,0} parameter(0)
  %buf = f32[3,8,16]{2,1,0} parameter(1)
  %transpose_fusion = f32[8,16]{1,0} fusion(%x), kind=kInput, calls=%fused_transpose
  %two = (f32[8,32]{1,0}, bf16[8,16]{1,0}) fusion(%transpose_fusion), kind=kLoop, calls=%fused_two
  %zero = s32[] constant(0)
  %init = (s32[], f32[3,8,16]{2,1,0}, f32[8,16]{1,0}) tuple(%zero, %buf, %transpose_fusion)
  %while.23 = (s32[], f32[3,8,16]{2,1,0}, f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %loop_out = f32[3,8,16]{2,1,0} get-tuple-element(%while.23), index=1
  %copy.24 = f32[3,8,16]{2,1,0} copy(%loop_out)
  %gemm = (f32[4]{0}, s8[32]{0}) custom-call(%x, %copy.24), custom_call_target="__cublas$gemm"
  %gemm_out = f32[4]{0} get-tuple-element(%gemm), index=0
  %pad_out = f32[8,32]{1,0} get-tuple-element(%two), index=0
  %mul_out = bf16[8,16]{1,0} get-tuple-element(%two), index=1
  ROOT %out = (f32[3,8,16]{2,1,0}, f32[8,32]{1,0}, bf16[8,16]{1,0}, f32[3,8,16]{2,1,0}, f32[4]{0}) tuple(%loop_out, %pad_out, %mul_out, %copy.24, %gemm_out)
}
"""  # noqa: E501 (HLO lines as XLA prints them)


class ParseTest(absltest.TestCase):
    def test_computations_entry_and_instructions(self):
        m = hlo_stats.parse(_TEXT)
        self.assertEqual(m.entry, "main")
        self.assertEqual(
            set(m.computations),
            {"fused_transpose", "fused_two", "fused_update", "body", "cond", "main"},
        )
        gemm = m.by_name("main")["gemm"]
        self.assertEqual(gemm.opcode, "custom-call")
        self.assertEqual(gemm.operands, ("x", "copy.24"))
        self.assertEqual(gemm.custom_call_target, "__cublas$gemm")
        self.assertEqual(m.by_name("main")["while.23"].attr("body"), "body")
        self.assertEqual(m.root("fused_two").name, "tuple.7")
        self.assertIn("input_output_alias", m.header)

    def test_shape_bytes(self):
        self.assertEqual(hlo_stats.shape_bytes("bf16[8,4,128]{2,1,0}"), 8 * 4 * 128 * 2)
        self.assertEqual(hlo_stats.shape_bytes("(f32[2,3]{1,0}, u8[0]{0}, s32[])"), 24 + 0 + 4)
        # a TPU layout's tiling is not a shape
        self.assertEqual(
            hlo_stats.shape_bytes("bf16[2,3584,128]{2,1,0:T(8,128)(2,1)S(1)}"), 2 * 3584 * 128 * 2
        )
        self.assertEqual(hlo_stats.shape_bytes("pred[7]{0}"), 7)


class WritesTest(absltest.TestCase):
    def test_loop_bodies_count_their_trips(self):
        m = hlo_stats.parse(_TEXT)
        self.assertEqual(hlo_stats.execution_counts(m), {"main": 1, "body": 3})

    def test_bytes_by_kind_by_hand(self):
        """transpose 8*16*4; the two-output fusion: a pad 8*32*4 and a multiply 8*16*2 (behind
        a bitcast); the in-place update writes its row, 8*16*4, three times (not the 3*8*16*4
        buffer); the copy 3*8*16*4; the custom call its outputs, 4*4 + 32; the loop counter's
        add 4 bytes three times."""
        by_kind = hlo_stats.bytes_by_kind(hlo_stats.parse(_TEXT))
        want = {
            "transpose": 512,
            "pad": 1024,
            "multiply": 256,
            "dynamic-update-slice": 3 * 512,
            "copy": 1536,
            "custom-call __cublas$gemm": 48,
            "add": 12,
        }
        self.assertEqual(by_kind, dict(sorted(want.items(), key=lambda kv: -kv[1])))
        layout = 512 + 1024 + 1536
        self.assertAlmostEqual(hlo_stats.layout_share(by_kind), layout / sum(want.values()))

    def test_custom_calls_with_operand_shapes(self):
        (call,) = hlo_stats.custom_calls(hlo_stats.parse(_TEXT), "cublas")
        self.assertEqual(call.target, "__cublas$gemm")
        self.assertEqual(call.operand_shapes, ("f32[16,8]{1,0}", "f32[3,8,16]{2,1,0}"))
        self.assertEqual(call.count, 1)
        self.assertEqual(hlo_stats.custom_calls(hlo_stats.parse(_TEXT), "cudnn"), [])

    def test_trip_count_from_the_condition_without_known_trip_count(self):
        """TPU's HLO prints no known_trip_count: the condition's `i < 3` gives it."""
        text = re.sub(r', backend_config=\{"known_trip_count[^\n]*\}\}', "", _TEXT)
        self.assertNotIn("known_trip_count", text)
        m = hlo_stats.parse(text)
        self.assertEqual(hlo_stats.execution_counts(m), {"main": 1, "body": 3})

    def test_an_instruction_over_several_lines(self):
        """A Mosaic call's backend_config holds newlines, some lines starting with '}}': they
        continue the instruction, and the instructions after it are still read."""
        call = '"__cublas$gemm", backend_config={"body":"a\n}}, x\n b"}'
        m = hlo_stats.parse(_TEXT.replace('"__cublas$gemm"', call))
        main = m.by_name("main")
        self.assertEqual(main["gemm"].custom_call_target, "__cublas$gemm")
        self.assertIn("gemm_out", main)
        self.assertEqual(
            hlo_stats.bytes_by_kind(m), hlo_stats.bytes_by_kind(hlo_stats.parse(_TEXT))
        )

    def test_largest_write(self):
        (w,) = hlo_stats.largest_writes(hlo_stats.parse(_TEXT), 1)
        self.assertEqual((w.kind, w.bytes, w.count), ("copy", 1536, 1))


class CompiledOnCpuTest(absltest.TestCase):
    """Programs XLA:CPU compiles: the parser reads real text, and loops count their trips."""

    def test_scan_writes_scale_with_its_length(self):
        def f(xs):  # 5 and 10 steps of one [64, 64] f32 product each
            def body(c, x):
                y = jnp.tanh(c @ x)
                return y, y

            return jax.lax.scan(body, jnp.eye(64), xs)

        def stats(n):
            xs = jax.ShapeDtypeStruct((n, 64, 64), jnp.float32)
            return hlo_stats.parse(jax.jit(f).lower(xs).compile().as_text())

        five, ten = stats(5), stats(10)
        body5 = [c for c, k in hlo_stats.execution_counts(five).items() if k == 5]
        self.assertTrue(body5, hlo_stats.execution_counts(five))
        total5 = sum(hlo_stats.bytes_by_kind(five).values())
        total10 = sum(hlo_stats.bytes_by_kind(ten).values())
        # per step at least the product's [64, 64] f32 (and the stacked output's row)
        self.assertGreaterEqual(total10 - total5, 5 * 64 * 64 * 4)

    def test_a_materialised_transpose_is_layout_traffic(self):
        x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
        text = jax.jit(lambda x: (x.T * 2.0, x + 1.0)).lower(x).compile().as_text()
        by_kind = hlo_stats.bytes_by_kind(hlo_stats.parse(text))
        # the transposed output is written by a layout op at least once (XLA:CPU writes it
        # twice: a transpose into a {0,1} layout, then a copy into the output's {1,0}); the other
        # output by its add
        size = 256 * 512 * 4
        layout = sum(by_kind.get(k, 0) for k in hlo_stats.LAYOUT_KINDS)
        self.assertGreaterEqual(layout, size, by_kind)
        self.assertEqual(by_kind["add"], size, by_kind)
        self.assertEqual(sum(by_kind.values()), layout + size, by_kind)


if __name__ == "__main__":
    absltest.main()
