"""INT4 -> bf16 dequantisation in PTX, two nibbles a 32-bit op: ``DEQUANT_BF16X2`` for the Triton
MoE kernel (``kernels/int4_moe.py``), ``DEQUANT_PAIRS`` for the Gluon one (``kernels/int4_moe_hopper.py``).

``DEQUANT_BF16X2``: inputs ``$8`` (an int32 word of 8 nibbles) and ``$9`` (its bf16 scale); outputs
``$0 .. $7``, nibble i as ``(n - 8) * scale`` in bf16. ``(w >> 4i) & 0x000F000F | 0x43004300`` is the bf16 pair
``(128 + n_i, 128 + n_{i+4})``; ``- 136`` is exact and ``* scale`` rounds once, as the reference's
float32 product rounded to bf16 does. The CPU interpreter cannot run PTX.
"""

__all__ = ["DEQUANT_BF16X2", "DEQUANT_BF16X2_CONSTRAINTS", "DEQUANT_PAIRS", "DEQUANT_PAIRS_CONSTRAINTS"]


def _pairs(word: str) -> str:
    """PTX: t0 .. t3 = bf16x2 ``(n_q - 8, n_{q+4} - 8)`` of the nibbles of ``word``, q = 0 .. 3."""
    lines = [f"lop3.b32 t0, {word}, 0x000F000F, 0x43004300, 0xea;"]
    for q in (1, 2, 3):
        lines += [f"shr.u32 t{q}, {word}, {4 * q};", f"lop3.b32 t{q}, t{q}, 0x000F000F, 0x43004300, 0xea;"]
    lines += [f"sub.rn.bf16x2 t{q}, t{q}, bias;" for q in range(4)]
    return "\n".join(lines)


DEQUANT_BF16X2 = "\n".join([
    "{",
    ".reg .b32 t0, t1, t2, t3, sc, bias;",
    "mov.b32 sc, {$9, $9};",
    "mov.b32 bias, 0x43084308;",
    _pairs("$8"),
    *[f"mul.rn.bf16x2 t{q}, t{q}, sc;" for q in range(4)],
    *[f"mov.b32 {{${q}, ${q + 4}}}, t{q};" for q in range(4)],
    "}",
])
DEQUANT_BF16X2_CONSTRAINTS = "=h,=h,=h,=h,=h,=h,=h,=h,r,h"

# The Gluon kernel's variant (``inline_asm_elementwise(pack=2)`` on a word joined with itself and
# its scale joined with itself): inputs ``$4`` / ``$5`` the word (twice) and ``$6`` the bf16x2 pair
# (scale, scale); outputs ``$0 .. $3`` each a bf16x2 register, output q holding nibbles (q, q + 4).
# Those pairs are the wgmma operand's register pairs in the kernel's K order, so no unpacking or
# re-pairing instructions are needed: 15 a word (3 shifts, 4 lop3, 4 sub, 4 mul).
DEQUANT_PAIRS = "\n".join([
    "{",
    ".reg .b32 t0, t1, t2, t3, bias;",
    "mov.b32 bias, 0x43084308;",
    _pairs("$4"),
    *[f"mul.rn.bf16x2 ${q}, t{q}, $6;" for q in range(4)],
    "}",
])
DEQUANT_PAIRS_CONSTRAINTS = "=r,=r,=r,=r,r,r,r"
