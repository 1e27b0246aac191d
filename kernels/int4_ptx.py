"""INT4 -> bf16 dequantisation in PTX, two nibbles a 32-bit op: ``DEQUANT_BF16X2`` for the Triton
MoE kernel (``kernels/int4_moe.py``), ``DEQUANT_PAIRS`` for the Gluon one (``kernels/int4_moe_hopper.py``).

``DEQUANT_BF16X2``: inputs ``$8`` (an int32 word of 8 nibbles) and ``$9`` (its bf16 scale); outputs
``$0 .. $7``, nibble i as ``(n - 8) * scale`` in bf16. ``(w >> 4i) & 0x000F000F | 0x43004300`` is the bf16 pair
``(128 + n_i, 128 + n_{i+4})``; ``- 136`` is exact and ``* scale`` rounds once, as the reference's
float32 product rounded to bf16 does. The CPU interpreter cannot run PTX.
"""

__all__ = ["DEQUANT_BF16X2", "DEQUANT_BF16X2_CONSTRAINTS", "DEQUANT_PAIRS", "DEQUANT_PAIRS_CONSTRAINTS"]

DEQUANT_BF16X2 = """
        {
        .reg .b32 t0, t1, t2, t3, sc, bias;
        mov.b32 sc, {$9, $9};
        mov.b32 bias, 0x43084308;
        lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t1, $8, 4;
        lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t2, $8, 8;
        lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t3, $8, 12;
        lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xea;
        sub.rn.bf16x2 t0, t0, bias;
        sub.rn.bf16x2 t1, t1, bias;
        sub.rn.bf16x2 t2, t2, bias;
        sub.rn.bf16x2 t3, t3, bias;
        mul.rn.bf16x2 t0, t0, sc;
        mul.rn.bf16x2 t1, t1, sc;
        mul.rn.bf16x2 t2, t2, sc;
        mul.rn.bf16x2 t3, t3, sc;
        mov.b32 {$0, $4}, t0;
        mov.b32 {$1, $5}, t1;
        mov.b32 {$2, $6}, t2;
        mov.b32 {$3, $7}, t3;
        }
        """
DEQUANT_BF16X2_CONSTRAINTS = "=h,=h,=h,=h,=h,=h,=h,=h,r,h"

# The Gluon kernel's variant (``inline_asm_elementwise(pack=2)`` on a word joined with itself and
# its scale joined with itself): inputs ``$4`` / ``$5`` the word (twice) and ``$6`` the bf16x2 pair
# (scale, scale); outputs ``$0 .. $3`` each a bf16x2 register, output q holding nibbles (q, q + 4).
# Those pairs are the wgmma operand's register pairs in the kernel's K order, so no unpacking or
# re-pairing instructions are needed: 15 a word (3 shifts, 4 lop3, 4 sub, 4 mul).
DEQUANT_PAIRS = """
        {
        .reg .b32 t0, t1, t2, t3, bias;
        mov.b32 bias, 0x43084308;
        lop3.b32 t0, $4, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t1, $4, 4;
        lop3.b32 t1, t1, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t2, $4, 8;
        lop3.b32 t2, t2, 0x000F000F, 0x43004300, 0xea;
        shr.u32 t3, $4, 12;
        lop3.b32 t3, t3, 0x000F000F, 0x43004300, 0xea;
        sub.rn.bf16x2 t0, t0, bias;
        sub.rn.bf16x2 t1, t1, bias;
        sub.rn.bf16x2 t2, t2, bias;
        sub.rn.bf16x2 t3, t3, bias;
        mul.rn.bf16x2 $0, t0, $6;
        mul.rn.bf16x2 $1, t1, $6;
        mul.rn.bf16x2 $2, t2, $6;
        mul.rn.bf16x2 $3, t3, $6;
        }
        """
DEQUANT_PAIRS_CONSTRAINTS = "=r,=r,=r,=r,r,r,r"
