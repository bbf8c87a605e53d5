"""The compiled kernels for GGUF block-quantized weights (kernels/cpu/gguf_quant.h,
gguf_gemm.h) against the `gguf` package's own dequantizer: x W^T for 1-8 rows
(gguf_linear_small) and for any number of bf16 rows (gguf_linear_tiled; with int8_x, the
integer GEMM) equals x times the dequantized W in fp32 to rounding (of bf16 x; of its int8
form where the int8 path runs: AVX2, AVX-512 VNNI), for every block type, on random blocks
(any bytes with finite scales are valid blocks) and odd output sizes; dequantized rows
equal the package's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_ops
from tests.gguf_tools import random_blocks
from tests.test_cpu_ops import amx_as

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no compiled CPU kernels")

NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def dequantized(blocks: np.ndarray, qtype: int, cols: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType(qtype))
                            .reshape(blocks.shape[0], cols).astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(NAMES), ids=lambda t: NAMES[t])
def test_gguf_rows_dequantize_as_the_gguf_package_does(qtype: int) -> None:
    cols = 512
    blocks = random_blocks(qtype, 9, cols, seed=qtype)
    want = dequantized(blocks, qtype, cols)
    w = torch.from_numpy(blocks)
    assert torch.equal(cpu_ops.gguf_dequant(w, qtype, cols, torch.float32), want)
    assert torch.equal(cpu_ops.gguf_dequant(w, qtype, cols, torch.bfloat16),
                       want.to(torch.bfloat16))


def x_as_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8 path multiplies it (gguf_quant.h XQ): per `group` values of a row,
    dx = max|x| / 127 and round(x / dx) (ties to even), times dx, in fp32."""
    xf = x.float().reshape(x.shape[0], -1, group)
    mx = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, 127.0 / mx, torch.zeros_like(mx))
    return (torch.round(xf * inv) * (mx / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("x_mode", ["fp32", "bf16", "fp32-int8"])
@pytest.mark.parametrize("qtype", sorted(NAMES), ids=lambda t: NAMES[t])
def test_gguf_linear_small_equals_the_dequantized_matmul(qtype: int, x_mode: str) -> None:
    """fp32 x: the exact sums. int8 x (bf16 x always; fp32 x where asked, on CPUs with an
    int8 path for the type: gguf_reads_int8): x quantized per gguf_x_group values (256;
    Q4_0/Q4_1 64; Q8_0 32 on AVX-512 VNNI, 64 on AVX2) times the dequantized W, to fp32
    rounding; the error that adds
    against fp32 x stays small. Else bf16 x as it is."""
    dtype = torch.bfloat16 if x_mode == "bf16" else torch.float32
    int8_x = x_mode != "fp32"
    cols, out = 768, 37  # 3 K-blocks a row; an output count no vector width divides
    blocks = random_blocks(qtype, out, cols, seed=100 + qtype)
    w = torch.from_numpy(blocks)
    ref = dequantized(blocks, qtype, cols)
    g = torch.Generator().manual_seed(qtype)
    bias = torch.randn(out, generator=g).to(dtype)
    quantized = int8_x and cpu_ops.gguf_reads_int8(qtype, cols)
    group = cpu_ops.gguf_x_group(qtype)  # (256; Q4_0/Q4_1 64; Q8_0 32, on AVX2 64)
    for rows in range(1, 9):
        x = torch.randn(rows, cols, generator=g).to(dtype)
        if rows == 2:
            x[1] = 0.0  # a row of zeros (dx 0)
        exact = x.float() @ ref.T + bias.float()
        want = x_as_int8(x, group) @ ref.T + bias.float() if quantized else exact
        got = cpu_ops.gguf_linear_small(x, w, qtype, bias, int8_x=int8_x)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(),
                                   rtol=tol)
        if quantized and dtype == torch.float32:  # what int8 x adds to the exact sums
            # (random x and codes: up to 1.2% of the largest output over 20 seeds; a bf16
            # output adds its own rounding, so that check is the one against `want`)
            assert (got - exact).abs().max() < 2e-2 * exact.abs().max()
    # into a column slice of a wider output
    x = torch.randn(3, cols, generator=g).to(dtype)
    wide = torch.zeros(3, out + 10, dtype=dtype)
    cpu_ops.gguf_linear_small(x, w, qtype, None, out=wide[:, 5 : 5 + out], int8_x=int8_x)
    assert not wide[:, :5].any() and not wide[:, 5 + out :].any()
    torch.testing.assert_close(wide[:, 5 : 5 + out].float(), x.float() @ ref.T,
                               atol=2e-2 * (x.float() @ ref.T).abs().max().item(), rtol=2e-2)
    if qtype in (2, 3, 8):  # 32-value types in rows not a multiple of 64: x as it is
        blocks = random_blocks(qtype, out, 96, seed=300 + qtype)
        ref = dequantized(blocks, qtype, 96)
        assert not cpu_ops.gguf_reads_int8(qtype, 96)
        x = torch.randn(2, 96, generator=g).to(dtype)
        got = cpu_ops.gguf_linear_small(x, torch.from_numpy(blocks), qtype, int8_x=int8_x)
        want = x.float() @ ref.T
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(),
                                   rtol=tol)


@pytest.mark.skipif(not cpu_ops.gguf_tiled(), reason="gguf_linear_tiled needs AVX512-BF16")
@pytest.mark.parametrize("amx", [False, True], ids=["avx512", "amx"])
@pytest.mark.parametrize("qtype", sorted(NAMES), ids=lambda t: NAMES[t])
def test_gguf_linear_tiled_equals_the_dequantized_matmul(qtype: int, amx: bool) -> None:
    """Any number of rows (the AVX-512 path's 6-row blocks, AMX's 16-row blocks in groups
    of 4, their tails, and more rows than one pass of x takes) against a weight whose row
    count leaves a partial last panel and a partial group of 4: x times the bf16
    dequantized W, summed in fp32, to rounding; bias added; a column slice as output."""
    with amx_as(amx):
        _tiled_against_dequantized(qtype)


def _tiled_against_dequantized(qtype: int) -> None:
    cols, out = 512, 37
    blocks = random_blocks(qtype, out, cols, seed=200 + qtype)
    w = torch.from_numpy(blocks)
    ref = dequantized(blocks, qtype, cols).to(torch.bfloat16).float()  # what the tile holds
    bias = torch.randn(out).to(torch.bfloat16)
    g = torch.Generator().manual_seed(qtype)
    for rows in (1, 5, 6, 7, 13, 64, 70, 1100):
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        want = x.float() @ ref.T + bias.float()
        got = cpu_ops.gguf_linear_tiled(x, w, qtype, bias)
        torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(),
                                   rtol=1e-2)
    x = torch.randn(9, cols, generator=g).to(torch.bfloat16)
    wide = torch.zeros(9, out + 10, dtype=torch.bfloat16)
    cpu_ops.gguf_linear_tiled(x, w, qtype, None, out=wide[:, 5 : 5 + out])
    assert not wide[:, :5].any() and not wide[:, 5 + out :].any()
    want = x.float() @ ref.T
    torch.testing.assert_close(wide[:, 5 : 5 + out].float(), want,
                               atol=1e-2 * want.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("qtype", sorted(NAMES), ids=lambda t: NAMES[t])
def test_gguf_int8_gemm_equals_the_dequantized_matmul(qtype: int) -> None:
    """The integer GEMM (gguf_linear_tiled with int8_x, kernels/cpu/gguf_gemm.h): x
    quantized per 256 values as the small kernel quantizes it for the K types (the
    32-value types per 32: a scale a block), times the dequantized W in
    fp32, to bf16 rounding, for the row blocks of 6 and every tail (1-5 rows, 7, 13, 64,
    70, 300), a zero row, a weight whose 37 rows leave a panel with one live column vector
    and an empty one, rows of 3 K blocks; bias added; a column slice as output."""
    if not cpu_ops.gguf_gemm_int8(qtype, 768):
        pytest.skip("the integer GEMM needs AVX-512 VNNI and BF16, AMX off")
    if qtype < 12:  # 32-value blocks in rows that are not a multiple of 256 values
        assert not cpu_ops.gguf_gemm_int8(qtype, 736)
    cols = 768
    group = 256 if qtype >= 12 else 32  # (the 32-value types: a scale of x a block)
    g = torch.Generator().manual_seed(qtype)
    for out in (37, 53):  # panels' halves: 5 live columns and none; 16 and 5
        blocks = random_blocks(qtype, out, cols, seed=400 + qtype + out)
        w = torch.from_numpy(blocks)
        ref = dequantized(blocks, qtype, cols)
        bias = torch.randn(out, generator=g).to(torch.bfloat16)
        for rows in (1, 2, 3, 4, 5, 6, 7, 13, 64, 70, 300):
            x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
            x[rows // 2] = 0.0
            want = x_as_int8(x, group) @ ref.T + bias.float()
            got = cpu_ops.gguf_linear_tiled(x, w, qtype, bias, int8_x=True)
            torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(),
                                       rtol=1e-2)
            # what int8 x adds to the exact product stays small
            exact = x.float() @ ref.T + bias.float()
            assert (got.float() - exact).abs().max() < 3e-2 * exact.abs().max()
    # a row with one large value: its 256-value group rounds the rest to a few steps, so
    # int8 x and the exact product differ plainly, and the kernel is the int8 one
    x = torch.randn(8, cols, generator=g).to(torch.bfloat16)
    x[:, 7] = 60.0
    got = cpu_ops.gguf_linear_tiled(x, w, qtype, None, int8_x=True).float()
    as_int8, exact = x_as_int8(x, group) @ ref.T, x.float() @ ref.T
    assert (got - as_int8).abs().max() < 0.2 * (got - exact).abs().max()
    x = torch.randn(9, cols, generator=g).to(torch.bfloat16)
    wide = torch.zeros(9, out + 10, dtype=torch.bfloat16)
    cpu_ops.gguf_linear_tiled(x, w, qtype, None, out=wide[:, 5 : 5 + out], int8_x=True)
    assert not wide[:, :5].any() and not wide[:, 5 + out :].any()
    want = x_as_int8(x, group) @ ref.T
    torch.testing.assert_close(wide[:, 5 : 5 + out].float(), want,
                               atol=1e-2 * want.abs().max().item(), rtol=1e-2)


packs = pytest.mark.skipif(not cpu_ops.gguf_packs(12),
                           reason="packed tiles need a CPU with AVX-512 VNNI")


@packs
@pytest.mark.parametrize("qtype", [12, 14, 8], ids=lambda t: NAMES[t])
def test_packed_tiles_equal_the_dequantized_matmul(qtype: int) -> None:
    """gguf_pack's Q4_K, Q6_K and Q8_0 tiles (kernels/cpu/gguf_packed.h) unpack to the same
    bytes, and gguf_packed_linear equals x quantized per 256 values (Q8_0: 32, on the GEMM
    too) times the dequantized W in fp32:
    its own kernel to 16 rows and for fp32 x (as the block kernel gives, to fp32
    rounding), the integer GEMM on the tiles past them (bf16 x), for 1-8, 13, 16, 17, 40, 300
    rows, a zero row, rows of 1-3 K blocks, 16 and 48 output rows (a GEMM panel with an
    empty half), with a bias and into a column slice."""
    g = torch.Generator().manual_seed(12)
    for out, cols in ((16, 256), (48, 768), (64, 512)):
        blocks = random_blocks(qtype, out, cols, seed=out + cols + qtype)
        w = torch.from_numpy(blocks)
        packed = cpu_ops.gguf_pack(w, qtype)
        assert packed.shape == (out // 16, cols // 256, cpu_ops.PACK_TILE_BYTES[qtype])
        assert torch.equal(cpu_ops.gguf_unpack(packed, qtype), w)
        ref = dequantized(blocks, qtype, cols)
        for dtype in (torch.float32, torch.bfloat16):
            bias = torch.randn(out, generator=g).to(dtype)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 40, 300):
                x = torch.randn(rows, cols, generator=g).to(dtype)
                x[rows // 2] = 0.0
                # x as the kernel quantizes it: Q8_0 per 64 values, per 32 on the GEMM
                group = cpu_ops.gguf_x_group(qtype)  # (Q8_0 32, the GEMM's too)
                want = x_as_int8(x, group) @ ref.T + bias.float()
                got = cpu_ops.gguf_packed_linear(x, packed, qtype, bias).float()
                # (1e-2: a value of x x 127 / max|x| that lies on a tie of the rounding
                # may round the other way in torch; 300 random rows meet one)
                torch.testing.assert_close(got, want, atol=1e-2 * want.abs().max().item(),
                                           rtol=1e-2)
                if dtype == torch.float32:  # the blocks' own kernel, 8 rows at a time
                    small = torch.cat([cpu_ops.gguf_linear_small(x[r : r + 8], w, qtype, bias,
                                                                 int8_x=True)
                                       for r in range(0, rows, 8)])
                    torch.testing.assert_close(got, small, atol=1e-5 * want.abs().max().item(),
                                               rtol=1e-5)
        for rows in (3, 40):
            x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
            wide = torch.zeros(rows, out + 10, dtype=torch.bfloat16)
            cpu_ops.gguf_packed_linear(x, packed, qtype, None, out=wide[:, 5 : 5 + out])
            assert not wide[:, :5].any() and not wide[:, 5 + out :].any()
            group = cpu_ops.gguf_x_group(qtype)
            want = x_as_int8(x, group) @ ref.T
            torch.testing.assert_close(wide[:, 5 : 5 + out].float(), want,
                                       atol=1e-2 * want.abs().max().item(), rtol=1e-2)


@packs
def test_gguf_linear_packs_q4k_parts_where_it_can(monkeypatch) -> None:
    """GGUFLinear with x in int8 repacks its Q4_K, Q6_K and Q8_0 parts of whole tiles
    (PackedWeight), keeps the others in their blocks, and gives what the blocks give (to the rounding of
    bf16 outputs) for decode rows and batches; not with pack=False (a matrix an embedding
    reads), TIDEWIRE_GGUF_PACK=0, or where AMX runs."""
    from engine.gguf_weights import PackedWeight, QuantWeight
    from engine.models.layers import GGUFLinear

    cols = 512
    parts = [QuantWeight(t, torch.from_numpy(random_blocks(t, n, cols, seed=t)), cols)
             for t, n in ((12, 32), (14, 16), (12, 24), (13, 16), (8, 16))]
    lin = GGUFLinear(parts, None, torch.bfloat16)
    plain = GGUFLinear(parts, None, torch.bfloat16, pack=False)
    assert [type(p).__name__ for p in lin.parts] == ["PackedWeight", "PackedWeight",
                                                     "QuantWeight", "QuantWeight",
                                                     "PackedWeight"]
    assert all(isinstance(p, QuantWeight) for p in plain.parts)
    assert lin.parts[0].shape == (32, cols)
    assert torch.equal(lin.parts[0].dequantize(), parts[0].dequantize())
    assert torch.equal(lin.parts[1].dequantize(), parts[1].dequantize())
    g = torch.Generator().manual_seed(3)
    for rows in (1, 4, 8, 40):
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        want = plain(x).float()
        torch.testing.assert_close(lin(x).float(), want, atol=1e-2 * want.abs().max().item(),
                                   rtol=1e-2)
    monkeypatch.setenv("TIDEWIRE_GGUF_PACK", "0")
    assert not isinstance(GGUFLinear(parts, None, torch.bfloat16).parts[0], PackedWeight)
    monkeypatch.delenv("TIDEWIRE_GGUF_PACK")
    if cpu_ops.amx():  # (on an AMX CPU; amx_as would skip the test elsewhere)
        with amx_as(True):
            assert not isinstance(GGUFLinear(parts, None, torch.bfloat16).parts[0],
                                  PackedWeight)


def test_gguf_int8_gemm_is_chosen_past_the_small_kernels_rows(monkeypatch) -> None:
    """GGUFLinear in bf16 sends a part's batches past small_limit rows (prefill chunks
    too) to the integer GEMM and fewer to the small kernel (Q6_K's to 6 rows, Q4_K's and
    Q4_0's to 4); where the GEMM does not run (AMX, other CPUs) small_limit is the small
    kernel's own. Outputs as the kernels' own."""
    from engine.gguf_weights import QuantWeight
    from engine.models.layers import GGUFLinear

    cols = 512
    parts = [QuantWeight(t, torch.from_numpy(random_blocks(t, n, cols, seed=t)), cols)
             for t, n in ((12, 40), (14, 24), (2, 8))]
    lin = GGUFLinear(parts, None, torch.bfloat16)
    gemm = cpu_ops.gguf_gemm_int8(12, cols)
    assert [lin.small_limit(p) for p in parts] == ([4, 6, 4] if gemm else [8, 8, 4])
    if not gemm:
        pytest.skip("the integer GEMM needs AVX-512 VNNI and BF16, AMX off")
    calls: list[tuple[str, int, bool]] = []
    small, tiled = cpu_ops.gguf_linear_small, cpu_ops.gguf_linear_tiled

    def spy_small(x, w, qtype, bias=None, out=None, int8_x=None):
        calls.append(("small", qtype, bool(int8_x)))
        return small(x, w, qtype, bias, out=out, int8_x=int8_x)

    def spy_tiled(x, w, qtype, bias=None, out=None, int8_x=False):
        calls.append(("tiled", qtype, bool(int8_x)))
        return tiled(x, w, qtype, bias, out=out, int8_x=int8_x)

    monkeypatch.setattr(cpu_ops, "gguf_linear_small", spy_small)
    monkeypatch.setattr(cpu_ops, "gguf_linear_tiled", spy_tiled)
    g = torch.Generator().manual_seed(5)
    routes = {4: [("small", 12, True), ("small", 14, True), ("small", 2, True)],
              6: [("tiled", 12, True), ("small", 14, True), ("tiled", 2, True)],
              7: [("tiled", 12, True), ("tiled", 14, True), ("tiled", 2, True)],
              300: [("tiled", 12, True), ("tiled", 14, True), ("tiled", 2, True)]}
    # rows of a width the GEMM does not take (Q4_0's 32-value blocks, 576 values): the
    # small kernel to 4 rows, then the bf16 tiles
    narrow = GGUFLinear([QuantWeight(2, torch.from_numpy(random_blocks(2, 8, 576, seed=9)),
                                     576)], None, torch.bfloat16)
    assert narrow.small_limit(narrow.parts[0]) == 4
    calls.clear()
    narrow(torch.randn(6, 576, generator=g).to(torch.bfloat16))
    assert calls == [("tiled", 2, False)]
    for rows, route in routes.items():
        calls.clear()
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        got = lin(x)
        assert calls == route
        o = 0
        for p in parts:
            # (Q4_0: its small kernel's x per 64 values, the GEMM's per 32)
            group = (64 if rows <= 4 else 32) if p.qtype == 2 else 256
            want = x_as_int8(x, group) @ dequantized(p.data.numpy(), p.qtype, cols).T
            part = got[:, o : o + p.rows].float()
            torch.testing.assert_close(part, want, atol=2e-2 * want.abs().max().item(),
                                       rtol=2e-2)
            o += p.rows


def test_int8_weights_take_the_integer_gemm_with_no_bf16_copy() -> None:
    """`--quantization int8` weights (int8 rows, an fp32 scale each) on the integer GEMM:
    x quantized per 32 values times q * s in fp32, to bf16 rounding, for the row tails
    and panel halves the GGUF tests use; Int8Linear in bf16 keeps no dequantized copy
    where the GEMM runs and sends batches past small_rows to it (fewer to linear_small)."""
    from engine.models.layers import Int8Linear

    cols = 768
    if not cpu_ops.gguf_gemm_int8(8, cols):
        pytest.skip("the integer GEMM needs AVX-512 VNNI and BF16, AMX off")
    g = torch.Generator().manual_seed(11)
    for out in (37, 53):
        q = torch.randint(-127, 128, (out, cols), generator=g, dtype=torch.int8)
        scale = torch.rand(out, generator=g) * 1e-2
        ref = q.float() * scale[:, None]
        bias = torch.randn(out, generator=g).to(torch.bfloat16)
        for rows in (1, 5, 6, 7, 13, 64, 300):
            x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
            want = x_as_int8(x, 32) @ ref.T + bias.float()
            got = cpu_ops.linear_int8_gemm(x, q, scale, bias)
            torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(),
                                       rtol=1e-2)
    lin = Int8Linear(q, scale, None, torch.bfloat16)
    assert lin.gemm and lin.dense is None
    for rows in (3, 5, 40):
        x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
        want = (cpu_ops.linear_small(x, q, scale) if rows <= Int8Linear.small_rows
                else cpu_ops.linear_int8_gemm(x, q, scale))
        assert torch.equal(lin(x), want)
    assert Int8Linear(q, scale, None, torch.float32).dense is not None  # fp32: exact sums
    assert Int8Linear(q[:, :736], scale, None, torch.bfloat16).dense is not None


def test_gguf_kernels_refuse_what_they_cannot_read() -> None:
    w = torch.from_numpy(random_blocks(12, 4, 256, seed=1))
    with pytest.raises(RuntimeError, match="type must be"):
        cpu_ops.gguf_linear_small(torch.randn(1, 256), w, 6)  # Q5_0
    with pytest.raises(RuntimeError, match="in a multiple of the block"):
        cpu_ops.gguf_linear_small(torch.randn(1, 128), w, 12)


def test_int4_writes_q4_k_blocks_the_gguf_package_reads_and_fits_them_better_than_q4_1() -> None:
    """`--quantization int4` (engine/quant.py): a matrix whose in_features is a multiple
    of 256 becomes Q4_K blocks (4.5 bits a weight), another Q4_1 (5); both decode, by the
    `gguf` package and by the kernels, to exactly quant.dequantize_int4, every value
    within half a quantization step of its weight (where the fitted range holds it), and
    the Q4_K fit's error is below Q4_1's on the same matrix."""
    from engine.quant import _quantize_q4_1, dequantize_int4, quantize_int4

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 768, generator=g) * 0.02 + torch.randn(40, 768, generator=g) ** 3 * 3e-3
    w[1, :256] = 0.01  # a constant block, an all-zero group, an outlier
    w[2, 32:64] = 0.0
    w[3, 500] = 0.4
    qtype, blocks = quantize_int4(w)
    assert qtype == 12 and blocks.shape == (40, 3 * 144)
    deq = dequantize_int4(qtype, blocks, 768)
    assert torch.equal(dequantized(blocks.numpy(), qtype, 768), deq)
    assert torch.equal(cpu_ops.gguf_dequant(blocks, qtype, 768, torch.float32), deq)
    assert torch.equal(deq[2, 32:64], torch.zeros(32))
    assert (deq[1, :256] - 0.01).abs().max() < 1e-4
    assert (deq[3, 500] - 0.4).abs() < 0.4 / 30
    q4_1 = dequantize_int4(3, _quantize_q4_1(w), 768)
    err = lambda d: (d - w).square().sum().sqrt() / w.square().sum().sqrt()  # noqa: E731
    assert err(deq) < 0.97 * err(q4_1)
    # values the sub-block's range holds are within half a step of the stored one
    x = w.reshape(40, 3, 8, 32)
    b = blocks.reshape(40, 3, 144).to(torch.int32)
    d = blocks.reshape(40, 3, 144)[..., :2].contiguous().view(torch.float16).float()
    sc = torch.cat([b[..., 4:8] & 63, (b[..., 12:16] & 0xF) | ((b[..., 4:8] >> 6) << 4)], -1)
    step = (d * sc)[..., None]
    inside = (deq.reshape(x.shape) - x).abs() <= step * 0.5 + 1e-6
    lo, hi = deq.reshape(x.shape).amin(-1, keepdim=True), deq.reshape(x.shape).amax(-1, keepdim=True)
    held = (x >= lo - step / 2) & (x <= hi + step / 2)
    assert inside[held].all() and held.float().mean() > 0.97
    qtype, blocks = quantize_int4(w[:, :96])  # 96 in_features: Q4_1
    assert qtype == 3 and torch.equal(
        dequantized(blocks.numpy(), 3, 96), dequantize_int4(3, blocks, 96))
