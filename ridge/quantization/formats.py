"""llama.cpp's block formats, in torch: the bytes a quantized layer holds are GGUF's bytes.

Every format quantizes along K in blocks of 32 weights with fp16 block constants, stored
row by row exactly as a GGUF tensor stores them (``blocks``: uint8, (N, K/32 * type_size)):

    Q8_0  [ d:f16 | q:int8 x 32 ]                         34 bytes   w = q * d
    Q4_0  [ d:f16 | nibbles x 16 ]                        18 bytes   w = (q - 8) * d
    Q4_1  [ d:f16 | m:f16 | nibbles x 16 ]                20 bytes   w = q * d + m
    IQ4_NL [ d:f16 | nibbles x 16 ]                       18 bytes   w = IQ4_NL_VALUES[q] * d

    nibbles: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits)

and six in super-blocks of 256 (sub-blocks of 32 or 16 with small integer scales under the
super-block's fp16 factors):

    Q4_K  [ d:f16 | dmin:f16 | 12 bytes: 8 x (sc, m) 6-bit | nibbles x 128 ]   144 bytes
          w = d * sc_j * q - dmin * m_j     (run c of 32 bytes: sub-block 2c low, 2c + 1 high)
    Q5_K  [ d | dmin | 12 bytes of (sc, m) | qh x 32 | nibbles x 128 ]         176 bytes
          Q4_K's, q + 16 * (bit j of qh[l]) for sub-block j's element l
    IQ4_XS [ d:f16 | 2 bytes: 8 x 2 high bits | 4 bytes: 8 x 4 low bits | nibbles x 128 ]  136 bytes
          w = d * (code_j - 32) * IQ4_NL_VALUES[q]   (sub-block j's 16 bytes as IQ4_NL's)
    Q6_K  [ 128 bytes: low 4 bits | 64 bytes: top 2 bits | 16 x int8 scale | d:f16 ]  210 bytes
          w = d * scale_i * (q - 32), a scale per 16 weights
    Q3_K  [ hmask x 32 | 2-bit codes x 64 | 12 bytes: 16 x 6-bit scale | d:f16 ]   110 bytes
          w = d * (sc_i - 32) * q, q = low 2 bits - (4 unless hmask's bit is set), per 16 weights
    Q2_K  [ 16 bytes: 4-bit sc | 4-bit m << 4 | 2-bit codes x 64 | d:f16 | dmin:f16 ]  84 bytes
          w = d * sc_i * q - dmin * m_i, per 16 weights
          (both: sub-block j's element l is bits 2 (j % 4) of byte 32 (j / 4) + l of the codes)

Quantization to Q8_0, Q4_0 and Q4_1 reproduces ``gguf.quants.quantize`` bit for bit (the same
float32 arithmetic in the same order, llama.cpp's rounding), so a file quantized by llama.cpp
and the same weights quantized by ridge at load hold identical bytes. Q4_K and Q6_K run
llama.cpp's reference quantizers (``quantize_row_q4_K_ref`` / ``_q6_K_ref``: a search over
candidate scales per sub-block, which ``gguf.quants`` lacks), vectorized; IQ4_NL, IQ4_XS,
Q5_K, Q3_K and Q2_K are read from files only. Any device; no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block (a K-quant's sub-block: what the kernels' groups are)


@dataclass(frozen=True)
class BlockFormat:
    """One block format: its name in ridge and in GGUF, and its bytes per block of 32."""

    name: str  # ridge's name (the --quantization value that produces it)
    ggml_name: str  # GGUF's tensor type name
    ggml_type: int  # GGUF's tensor type id
    type_size: int  # bytes per block
    offset: int  # q - offset is the signed code (8 for Q4_0, 0 otherwise)
    has_min: bool  # Q4_1: a per-block minimum besides the scale
    nibbles: bool  # 4-bit codes (Q5_K: their low 4 bits), two per byte
    codebook: tuple[int, ...] | None = None  # IQ4_NL: each code indexes these values (not q - offset)
    block: int = BLOCK  # weights per block: 256 for a K-quant's super-block
    code_bits: int = 4  # bits of a weight's code (8: Q8_0's bytes; 2, 3, 5, 6: Q2_K's ... Q6_K's)
    # the CPU kernel quantizes x to int8 per this many k: 32 (llama.cpp's Q8_0), or a
    # super-block (Q8_K's 256), where the sums of a super-block's groups then add as integers
    activation_block: int = BLOCK

    @property
    def arithmetic_bits(self) -> int:
        """The width the integer kernels multiply a code at: a nibble, or else a byte."""
        return 4 if self.code_bits <= 4 else 8

    @property
    def quantizable(self) -> bool:
        """Whether ridge produces it at load (``--quantization``); the others come from files."""
        return self.name in _QUANTIZE

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.type_size

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """(N, K) float weights, K a multiple of 32 -> (N, K/32 * type_size) uint8 blocks."""
        if not self.quantizable:
            raise ValueError(f"{self.ggml_name} is read from GGUF files only; ridge does not quantize to it")
        if w.dim() == 2 and w.shape[1] % self.block:
            raise ValueError(f"{self.ggml_name} needs K a multiple of {self.block}, got {tuple(w.shape)}")
        if self.block > BLOCK:  # the K-quants' searches: a few rows at a time keep their temporaries in cache
            rows = max(1, (1 << 16) // w.shape[1])
            return torch.cat([_QUANTIZE[self.name](_blocks_of(w[i : i + rows])) for i in range(0, w.shape[0], rows)])
        return _QUANTIZE[self.name](_blocks_of(w))

    def dequantize(self, blocks: torch.Tensor, k: int) -> torch.Tensor:
        """(N, K/32 * type_size) uint8 -> (N, K) float32 weights."""
        n = blocks.shape[0]
        if self.name in _DEQUANTIZE_SUPER:
            return _DEQUANTIZE_SUPER[self.name](blocks.reshape(n, k // self.block, self.type_size)).reshape(n, k)
        b = blocks.reshape(n, k // BLOCK, self.type_size)
        d = _f16(b[..., 0:2])
        if self.nibbles:
            start = 4 if self.has_min else 2
            packed = b[..., start:]
            q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # elements 0-15, then 16-31
            q = torch.tensor(self.codebook, device=q.device)[q.long()].float() if self.codebook else q.float()
        else:
            q = b[..., 2:].contiguous().view(torch.int8).float()
        w = (q - self.offset) * d.unsqueeze(-1)
        if self.has_min:
            w = w + _f16(b[..., 2:4]).unsqueeze(-1)
        return w.reshape(n, k)


Q8_0 = BlockFormat("int8", "Q8_0", 8, 34, offset=0, has_min=False, nibbles=False, code_bits=8)
Q4_0 = BlockFormat("int4", "Q4_0", 2, 18, offset=8, has_min=False, nibbles=True)
Q4_1 = BlockFormat("int4_asym", "Q4_1", 3, 20, offset=0, has_min=True, nibbles=True)
# llama.cpp's kvalues_iq4nl: 16 non-linear steps, denser near zero where weights are
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
IQ4_NL = BlockFormat("iq4_nl", "IQ4_NL", 20, 18, offset=0, has_min=False, nibbles=True, codebook=IQ4_NL_VALUES)
Q4_K = BlockFormat("q4_k", "Q4_K", 12, 144, offset=0, has_min=True, nibbles=True, block=256)
IQ4_XS = BlockFormat(
    "iq4_xs", "IQ4_XS", 23, 136, offset=0, has_min=False, nibbles=True, codebook=IQ4_NL_VALUES, block=256
)
Q5_K = BlockFormat(
    "q5_k", "Q5_K", 13, 176, offset=0, has_min=True, nibbles=True, block=256, code_bits=5, activation_block=256
)
Q6_K = BlockFormat(
    "q6_k", "Q6_K", 14, 210, offset=32, has_min=False, nibbles=False, block=256, code_bits=6, activation_block=256
)
Q3_K = BlockFormat(
    "q3_k", "Q3_K", 11, 110, offset=4, has_min=False, nibbles=False, block=256, code_bits=3, activation_block=256
)
Q2_K = BlockFormat(
    "q2_k", "Q2_K", 10, 84, offset=0, has_min=True, nibbles=False, block=256, code_bits=2, activation_block=256
)
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (Q8_0, Q4_0, Q4_1, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K, Q2_K)}
FORMATS_BY_GGML_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}
# --quantization accepts ridge's names and llama.cpp's
FORMAT_ALIASES = {"q8_0": "int8", "q4_0": "int4", "q4_1": "int4_asym"}


def get_format(name: str) -> BlockFormat:
    """A format ``--quantization`` can produce, by ridge's or llama.cpp's name."""
    key = FORMAT_ALIASES.get(name.lower(), name.lower())
    if key not in QUANTIZATION_FORMATS:
        choices = ", ".join([*QUANTIZATION_FORMATS, *FORMAT_ALIASES])
        raise ValueError(f"unknown quantization {name!r}; choose one of {choices}")
    return FORMATS[key]


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 144) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it."""
    return _dequantize_k_scaled(b, _k_nibbles(b[..., 16:]))


def _dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 176) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it:
    Q4_K's nibbles plus a fifth bit per weight, bit j of qh[l] for sub-block j's element l."""
    qh = b[..., 16:48].long().unsqueeze(-2)  # (N, S, 1, 32)
    top = (qh >> torch.arange(8, device=b.device).view(8, 1)) & 1  # (N, S, 8, 32)
    return _dequantize_k_scaled(b, _k_nibbles(b[..., 48:]) + 16 * top.float())


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of a Q4_K/Q5_K super-block -> (..., 8, 32) codes: run c of 32 bytes holds
    sub-block 2c in its low nibbles and 2c + 1 in its high ones."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([runs & 15, runs >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32).float()


def _dequantize_k_scaled(b: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """w = d * sc_j * q - dmin * m_j with Q4_K's and Q5_K's 12 bytes of 6-bit (sc, m) codes."""
    d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
    q = b[..., 4:16].long()
    lo, mid, top = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    sc = torch.cat([lo & 63, (top & 15) | ((lo >> 6) << 4)], dim=-1).float()  # (N, S, 8)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1).float()
    return ((d * sc).unsqueeze(-1) * codes - (dmin * m).unsqueeze(-1)).reshape(*b.shape[:-1], 256)


def _dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 136) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it."""
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    high = b[..., 2].long() | (b[..., 3].long() << 8)  # 2 bits per sub-block
    low = b[..., 4:8].long()
    j = torch.arange(8, device=b.device)
    codes = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high.unsqueeze(-1) >> (2 * j)) & 3) << 4)
    scale = d * (codes - 32).float()  # (N, S, 8)
    qs = b[..., 8:].reshape(*b.shape[:-1], 8, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=-1).long()
    values = torch.tensor(IQ4_NL_VALUES, device=b.device)[q].float()
    return (scale.unsqueeze(-1) * values).reshape(*b.shape[:-1], 256)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 210) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it."""
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*lead, 2, 4, 32)  # (half, quarter, l)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32).long()
    top = (qh >> (2 * torch.arange(4, device=b.device)).view(4, 1)) & 3  # (half, quarter, l)
    q = ((low.long() | (top << 4)) - 32).reshape(*lead, 16, 16).float()
    scale = _f16(b[..., 208:210]).unsqueeze(-1) * b[..., 192:208].contiguous().view(torch.int8).float()
    return (scale.unsqueeze(-1) * q).reshape(*lead, 256)


def _two_bit_codes(qs: torch.Tensor) -> torch.Tensor:
    """64 bytes of Q2_K/Q3_K codes -> (..., 16, 16) codes 0-3 per sub-block of 16: sub-block
    j of 32 holds its element l in bits 2 (j % 4) of byte 32 (j / 4) + l."""
    runs = qs.reshape(*qs.shape[:-1], 2, 1, 32).long()
    return ((runs >> (2 * torch.arange(4, device=qs.device)).view(4, 1)) & 3).reshape(*qs.shape[:-1], 16, 16)


def _dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 110) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it."""
    lead = b.shape[:-1]
    high = (b[..., 0:32].long().unsqueeze(-2) >> torch.arange(8, device=b.device).view(8, 1)) & 1  # (8, 32)
    q = _two_bit_codes(b[..., 32:96]) - 4 * (1 - high.reshape(*lead, 16, 16))
    sc = b[..., 96:108].long()
    i = torch.arange(16, device=b.device)
    codes = ((sc[..., i % 8] >> (4 * (i // 8))) & 15) | (((sc[..., 8 + i % 4] >> (2 * (i // 4))) & 3) << 4)
    scale = _f16(b[..., 108:110]).unsqueeze(-1) * (codes - 32).float()  # (N, S, 16)
    return (scale.unsqueeze(-1) * q.float()).reshape(*lead, 256)


def _dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    """(N, S, 84) uint8 super-blocks -> (N, S, 256) float32, as gguf.quants computes it."""
    d, dmin = _f16(b[..., 80:82]).unsqueeze(-1), _f16(b[..., 82:84]).unsqueeze(-1)
    sc = b[..., 0:16]
    scale, minimum = d * (sc & 15).float(), dmin * (sc >> 4).float()  # (N, S, 16)
    q = _two_bit_codes(b[..., 16:80]).float()
    return (scale.unsqueeze(-1) * q - minimum.unsqueeze(-1)).reshape(*b.shape[:-1], 256)


_DEQUANTIZE_SUPER = {
    "q4_k": _dequantize_q4_k,
    "q5_k": _dequantize_q5_k,
    "iq4_xs": _dequantize_iq4_xs,
    "q6_k": _dequantize_q6_k,
    "q3_k": _dequantize_q3_k,
    "q2_k": _dequantize_q2_k,
}


def _blocks_of(w: torch.Tensor) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"block quantization needs (N, K) with K a multiple of {BLOCK}, got {tuple(w.shape)}")
    return w.float().reshape(w.shape[0], -1, BLOCK)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    return two_bytes.contiguous().view(torch.float16).squeeze(-1).float()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(..., 1) float32 -> (..., 2) uint8: the fp16 value's little-endian bytes."""
    return x.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # llama.cpp's roundf, as gguf-py spells it (exact: a - floor(a) and its double are exact)
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes 0-15 -> (..., 16) bytes: element j low, element j + 16 high."""
    return q[..., :16] | (q[..., 16:] << 4)


def _quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1).reshape(blocks.shape[0], -1)


def _quantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # d = the signed value of largest magnitude / -8 (not amax / 7): the first such value
    imax = blocks.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(blocks, -1, imax) / -8
    q = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=-1).reshape(blocks.shape[0], -1)


def _quantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    hi = blocks.amax(dim=-1, keepdim=True)
    lo = blocks.amin(dim=-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], dim=-1).reshape(blocks.shape[0], -1)


# -- the K-quants: llama.cpp's reference quantizers (quantize_row_q4_K_ref, _q6_K_ref), the
# same searches over candidate scales vectorized over every sub-block at once. Sums run in
# torch's order, not C's one-by-one float order, so a near tie between two candidates can fall
# the other way (rare; either is as good).


def _nearest_int(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # llama.cpp's nearest_int (the 1.5 * 2^23 trick): half to even


def _make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants (squared error) over (..., n) sub-blocks: the (scale, min)
    pair of least weighted error among nstep + 2 candidate scales -> (scale, -min, codes).

    As in C, each candidate rounds x - min with the min of the best fit so far; a candidate's
    error comes from its sums (sum w (s l + m - x)^2 expanded), and the codes of the winner are
    rounded once at the end from its (iscale, min)."""
    mn = mn0 = x.amin(-1).clamp(max=0)
    rng = x.amax(-1) - mn
    flat = rng == 0
    rng = torch.where(flat, torch.ones_like(rng), rng)
    sum_w, sum_x, sum_x2 = w.sum(-1), (w * x).sum(-1), (w * x * x).sum(-1)

    def fit(iscale, lo):
        cand = _nearest_int(iscale.unsqueeze(-1) * (x - lo.unsqueeze(-1))).clamp_(0, nmax)
        wl = w * cand
        return wl.sum(-1), (wl * cand).sum(-1), (wl * x).sum(-1)

    def error(scale, m, sum_l, sum_l2, sum_xl):
        return (
            scale * scale * sum_l2 + 2 * scale * m * sum_l - 2 * scale * sum_xl + m * m * sum_w - 2 * m * sum_x + sum_x2
        )

    iscale = nmax / rng
    scale = 1 / iscale
    best = error(scale, mn, *fit(iscale, mn))
    best_iscale, best_lo = iscale, mn
    rmin_, rdelta_ = torch.tensor(rmin), torch.tensor(rdelta)  # float32 arithmetic, as C's
    for step in range(nstep + 1):
        iscale = (rmin_ + rdelta_ * step + nmax) / rng
        sum_l, sum_l2, sum_xl = fit(iscale, mn)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        clipped = this_min > 0
        this_scale = torch.where(clipped, sum_xl / torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2)), this_scale)
        this_min = torch.where(clipped, torch.zeros_like(this_min), this_min)
        err = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        take = (det > 0) & (err < best)
        best = torch.where(take, err, best)
        best_iscale, best_lo = torch.where(take, iscale, best_iscale), torch.where(take, mn, best_lo)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    codes = _nearest_int(best_iscale.unsqueeze(-1) * (x - best_lo.unsqueeze(-1))).clamp(0, nmax)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    codes = torch.where(flat.unsqueeze(-1), torch.zeros_like(codes), codes)
    return scale, -torch.where(flat, mn0, mn), codes


def _quantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 32) -> (N, K/256 * 144) uint8, llama.cpp's quantize_row_q4_K_ref."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, 8, 32)
    av_x = (x.square().sum(-1, keepdim=True) / 32).sqrt()
    scales, mins, codes = _make_qkx2_quants(x, av_x + x.abs(), 15, -1.0, 0.1, 20)
    max_scale, max_min = scales.amax(-1, keepdim=True), mins.amax(-1, keepdim=True)
    ls = _nearest_int(scales * (63 / max_scale).nan_to_num(0, 0, 0)).clamp(max=63).to(torch.uint8)
    lm = _nearest_int(mins * (63 / max_min).nan_to_num(0, 0, 0)).clamp(max=63).to(torch.uint8)
    d, dmin = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    step = d.float() * ls.float()  # the codes again, under the stored scales (where one is not 0)
    redo = _nearest_int((x + (dmin.float() * lm.float()).unsqueeze(-1)) / step.unsqueeze(-1)).clamp(0, 15)
    codes = torch.where((step != 0).unsqueeze(-1), redo, codes).to(torch.uint8)
    packed = torch.cat(
        [
            ls[..., :4] | ((ls[..., 4:] >> 4) << 6),
            lm[..., :4] | ((lm[..., 4:] >> 4) << 6),
            (ls[..., 4:] & 15) | ((lm[..., 4:] & 15) << 4),
        ],
        dim=-1,
    )
    pairs = codes.reshape(n, -1, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, -1, 128)
    return torch.cat(
        [d.view(torch.uint8).reshape(n, -1, 2), dmin.view(torch.uint8).reshape(n, -1, 2), packed, qs], -1
    ).reshape(n, -1)


def _make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qx_quants (rmse_type 1: weights x^2) over (..., n) sub-blocks: the
    symmetric scale of least weighted error among 19 candidates -> (scale, codes + nmax)."""
    imax = x.abs().argmax(-1, keepdim=True)
    mx = torch.gather(x, -1, imax).squeeze(-1)
    zero = mx.abs() < 1e-15  # GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x

    def fit(iscale):
        cand = _nearest_int(iscale.unsqueeze(-1) * x).clamp(-nmax, nmax - 1)
        return cand, (w * x * cand).sum(-1), (w * cand * cand).sum(-1)

    codes, sumlx, suml2 = fit(-nmax / mx)
    scale = torch.where(
        suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx)
    )
    best = scale * sumlx
    tenth = torch.tensor(0.1)
    for step in range(-9, 10):
        if step == 0:
            continue
        cand, slx, sl2 = fit(-(nmax + tenth * step) / mx)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        codes = torch.where(take.unsqueeze(-1), cand, codes)
        scale = torch.where(take, slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), scale)
        best = torch.where(take, scale * slx, best)
    return torch.where(zero, torch.zeros_like(scale), scale), codes + nmax


def _quantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 32) -> (N, K/256 * 210) uint8, llama.cpp's quantize_row_q6_K_ref."""
    n = blocks.shape[0]
    x = blocks.reshape(n, -1, 16, 16)
    scales, found = _make_qx_quants(x, 32)
    imax = scales.abs().argmax(-1, keepdim=True)
    max_scale = torch.gather(scales, -1, imax)  # the signed scale of largest magnitude
    zero = max_scale.abs() < 1e-15
    iscale = -128 / torch.where(zero, torch.ones_like(max_scale), max_scale)
    d = torch.where(zero, torch.zeros_like(iscale), 1 / iscale).to(torch.float16)
    sc = _nearest_int(iscale * scales).clamp(max=127)
    sc = torch.where(zero, torch.zeros_like(sc), sc).to(torch.int8)
    step = d.float() * sc.float()
    codes = _nearest_int(x / torch.where(step != 0, step, torch.ones_like(step)).unsqueeze(-1)).clamp(-32, 31) + 32
    codes = torch.where((step != 0).unsqueeze(-1), codes, found)  # a zero scale keeps the search's codes
    codes = torch.where(zero.unsqueeze(-1), torch.zeros_like(codes), codes).to(torch.uint8)  # an all-zero block
    # 128 elements per half: ql[l] = q(l) | q(l + 64) << 4, ql[l + 32] = q(l + 32) | q(l + 96) << 4,
    # qh[l] = the top 2 bits of q(l), q(l + 32), q(l + 64), q(l + 96) at bits 0, 2, 4, 6
    q = codes.reshape(n, -1, 2, 4, 32)
    ql = torch.cat([q[..., 0, :] & 15 | ((q[..., 2, :] & 15) << 4), q[..., 1, :] & 15 | ((q[..., 3, :] & 15) << 4)], -1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    s = ql.shape[1]
    return torch.cat(
        [ql.reshape(n, s, 128), qh.reshape(n, s, 64), sc.view(torch.uint8), d.view(torch.uint8).reshape(n, s, 2)], -1
    ).reshape(n, -1)


_QUANTIZE = {
    "int8": _quantize_q8_0,
    "int4": _quantize_q4_0,
    "int4_asym": _quantize_q4_1,
    "q4_k": _quantize_q4_k,
    "q6_k": _quantize_q6_k,
}

# the formats --quantization produces at load (the others are read from files only)
QUANTIZATION_FORMATS = tuple(name for name, f in FORMATS.items() if f.quantizable)
