"""The KVarN tile codec in plain torch (arXiv 2606.03458): the reference that the packed-KV kernels must
match, and which runs on CPU.

A tile is X [G tokens, D channels] of one kv head's keys or values (any leading batch dims: [..., G, D]).
1. Rotation: X_r = X H, H the orthonormal Sylvester-Hadamard matrix of size D. Queries are rotated alike
   (q_r . k_r = q . k), and an attention output over rotated values is rotated back (out = out_r H^T).
2. Variance normalization, Sinkhorn-style in the log domain: X_r = diag(r) N diag(c). Alternately divide
   N's columns and rows by their standard deviation (two-pass, centred), accumulating log c and log r, and
   keep the iterate whose imbalance (the largest over the smallest row and column std of N) is lowest.
3. Asymmetric round-to-nearest of N with the normalization scales folded into the matching axis:
   keys   K ~ r_i (q_ij s_j + z_j)    per-channel scale s and zero z, per-token scale r
   values V ~ c_j (q_ij t_i + u_i)    per-channel scale c, per-token scale t and zero u
   Every scale is stored fp16, and codes are computed against the stored scales.
These foldings make attention cheap over codes: a score is r_i (sum_j (q_j s_j) code_ij + q . z), and an
output channel is c_j (sum_i (p_i t_i) code_ij + sum_i p_i u_i) (`packed_scores`, `packed_output`).

Codes pack along the channels of each token row, into bit planes of 4, 2 or 1 bits: 4 bits one nibble
plane, 2 bits one crumb plane, 8 bits two nibble planes. 5 bits take a plane of D / 2 bytes and one of
D / 8 bytes too, but not bit by bit: each column of 8 codes (channels 8c .. 8c + 7) is one 40-bit integer,
code k at bit 5k, whose low 32 bits are the first plane's bytes 4c .. 4c + 3 (little-endian) and whose
high 8 bits are the second plane's byte c. The decode kernel then takes every code out of a word in place
(attention/kernels/kvarn_decode.py) instead of merging a code's bits from two planes.

A pool record (one tile of G rows, [G, D * bits / 8] bytes) holds its rows' planes side by side, a row
after a row, except at 5 bits (record_codes): first every row's 4-byte words (row r at r * D / 2), then
the high bytes by 8-row groups, column-major within a group (row r, column c at G * D / 2 + (r // 8) * D +
8c + r % 8), so that a kernel reads the 8 high bytes of 8 consecutive rows of a column in one load.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from attention import fp8

FP16_MAX = 65504.0
PLANES = {2: (2,), 4: (4,), 5: (4, 1), 8: (4, 4)}


def hadamard(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size n (a power of two): symmetric, H H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def centred_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Population standard deviation in two passes (mean first, then the mean squared deviation), which
    keeps its precision where E[x^2] - E[x]^2 would cancel."""
    return (x - x.mean(dim, keepdim=True)).square().mean(dim).sqrt()


def sinkhorn_normalize(x: torch.Tensor, iterations: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """log r [..., G] and log c [..., D] of the best-balanced iterate, x = diag(r) N diag(c) [..., G, D]. A
    std is clamped to [1e-3, 1e3] times the tile's own std, so a constant row or column stays finite."""
    x = x.float()
    floor = centred_std(x.flatten(-2), -1).clamp_min(1e-30)[..., None]
    log_r = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    log_c = torch.zeros(x.shape[:-2] + x.shape[-1:], dtype=torch.float32, device=x.device)

    def clamped_log(std: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.clamp(std, min=floor * 1e-3, max=floor * 1e3))

    def imbalance(n: torch.Tensor) -> torch.Tensor:
        stds = torch.cat([centred_std(n, -1), centred_std(n, -2)], -1)
        return stds.amax(-1) / stds.amin(-1).clamp_min(1e-30)

    def normalized() -> torch.Tensor:
        return x * torch.exp(-log_r)[..., :, None] * torch.exp(-log_c)[..., None, :]

    best = imbalance(x)
    best_r, best_c = log_r.clone(), log_c.clone()
    for _ in range(iterations):
        log_c = log_c + clamped_log(centred_std(normalized(), -2))
        log_r = log_r + clamped_log(centred_std(normalized(), -1))
        score = imbalance(normalized())
        better = score < best
        best = torch.where(better, score, best)
        best_r = torch.where(better[..., None], log_r, best_r)
        best_c = torch.where(better[..., None], log_c, best_c)
    return best_r, best_c


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """x as stored: fp16, clamped to its finite range, back in fp32."""
    return x.clamp(-FP16_MAX, FP16_MAX).half().float()


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """round((x - zero) / scale) in [0, 2^bits - 1], uint8; a zero scale (a constant run) gives code 0."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round((x - zero) / safe).clamp(0, (1 << bits) - 1).to(torch.uint8)


@dataclasses.dataclass
class QuantizedKeys:
    codes: torch.Tensor  # [..., G, D] uint8 (unpacked)
    channel_scale: torch.Tensor  # [..., D] fp16
    channel_zero: torch.Tensor  # [..., D] fp16
    token_scale: torch.Tensor  # [..., G] fp16


@dataclasses.dataclass
class QuantizedValues:
    codes: torch.Tensor  # [..., G, D] uint8 (unpacked)
    channel_scale: torch.Tensor  # [..., D] fp16
    token_scale: torch.Tensor  # [..., G] fp16
    token_zero: torch.Tensor  # [..., G] fp16


def quantize_keys(x: torch.Tensor, bits: int, iterations: int = 8) -> QuantizedKeys:
    """x [..., G, D] (rotated already): per-channel asymmetric codes of the normalized tile, with the channel
    normalization folded into the channel scale and zero and the token normalization kept per token."""
    x = x.float()
    log_r, log_c = sinkhorn_normalize(x, iterations)
    r = _fp16(torch.exp(log_r))
    n = x / r[..., :, None] / torch.exp(log_c)[..., None, :]
    low, high = n.amin(-2), n.amax(-2)
    c = torch.exp(log_c)
    scale = _fp16(c * (high - low) / ((1 << bits) - 1))
    zero = _fp16(c * low)
    codes = _codes(x / r[..., :, None], scale[..., None, :], zero[..., None, :], bits)
    return QuantizedKeys(codes, scale.half(), zero.half(), r.half())


def dequantize_keys(q: QuantizedKeys) -> torch.Tensor:
    return q.token_scale.float()[..., :, None] * (q.codes.float() * q.channel_scale.float()[..., None, :]
                                                  + q.channel_zero.float()[..., None, :])


def quantize_values(x: torch.Tensor, bits: int, iterations: int = 8) -> QuantizedValues:
    """x [..., G, D] (rotated already): per-token asymmetric codes of the normalized tile, with the token
    normalization folded into the token scale and zero and the channel normalization kept per channel."""
    x = x.float()
    log_r, log_c = sinkhorn_normalize(x, iterations)
    c = _fp16(torch.exp(log_c))
    n = x / torch.exp(log_r)[..., :, None] / c[..., None, :]
    low, high = n.amin(-1), n.amax(-1)
    r = torch.exp(log_r)
    scale = _fp16(r * (high - low) / ((1 << bits) - 1))
    zero = _fp16(r * low)
    codes = _codes(x / c[..., None, :], scale[..., :, None], zero[..., :, None], bits)
    return QuantizedValues(codes, c.half(), scale.half(), zero.half())


def dequantize_values(q: QuantizedValues) -> torch.Tensor:
    return q.channel_scale.float()[..., None, :] * (q.codes.float() * q.token_scale.float()[..., :, None]
                                                    + q.token_zero.float()[..., :, None])


def packed_scores(q: torch.Tensor, keys: QuantizedKeys) -> torch.Tensor:
    """q [..., D] (rotated) against one tile's key codes [..., G, D]: the G scores q . k_i, with the channel
    scale folded into the query and the token scale applied once per score."""
    folded = q.float() * keys.channel_scale.float()
    offset = (q.float() * keys.channel_zero.float()).sum(-1, keepdim=True)
    return keys.token_scale.float() * ((keys.codes.float() @ folded[..., :, None])[..., 0] + offset)


def packed_output(p: torch.Tensor, values: QuantizedValues) -> torch.Tensor:
    """p [..., G] attention weights over one tile's value codes: sum_i p_i v_i [..., D] (rotated), with the
    token scale folded into the weights and the channel scale applied once per channel."""
    weighted = p.float() * values.token_scale.float()
    acc = (weighted[..., None, :] @ values.codes.float())[..., 0, :]
    offset = (p.float() * values.token_zero.float()).sum(-1, keepdim=True)
    return values.channel_scale.float() * (acc + offset)


def pack_codes(codes: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """codes [..., D] uint8 < 2^bits into bit planes, each [..., D * width / 8] uint8: plane 0 holds the low
    `width` bits, value j of a byte in bits j * width onward (little-endian within the byte); 5-bit codes
    as 40-bit columns (the module docstring)."""
    if bits not in PLANES:
        raise ValueError(f"codes of {bits} bits do not pack; supported: {sorted(PLANES)}")
    if bits == 5:
        return _pack_five_bit_columns(codes)
    planes, shift = [], 0
    for width in PLANES[bits]:
        per_byte = 8 // width
        if codes.shape[-1] % per_byte:
            raise ValueError(f"a row of {codes.shape[-1]} codes does not fill whole bytes of {width}-bit "
                             "values")
        part = ((codes.to(torch.int32) >> shift) & ((1 << width) - 1)).view(*codes.shape[:-1], -1, per_byte)
        weights = torch.tensor([1 << (width * j) for j in range(per_byte)], dtype=torch.int32,
                               device=codes.device)
        planes.append((part * weights).sum(-1).to(torch.uint8))
        shift += width
    return planes


def unpack_codes(planes: list[torch.Tensor], bits: int) -> torch.Tensor:
    if bits == 5:
        return _unpack_five_bit_columns(*planes)
    codes, shift = None, 0
    for plane, width in zip(planes, PLANES[bits]):
        per_byte = 8 // width
        shifts = torch.tensor([width * j for j in range(per_byte)], dtype=torch.int32, device=plane.device)
        part = ((plane.to(torch.int32)[..., None] >> shifts) & ((1 << width) - 1)).flatten(-2)
        codes = part << shift if codes is None else codes | (part << shift)
        shift += width
    return codes.to(torch.uint8)


def _pack_five_bit_columns(codes: torch.Tensor) -> list[torch.Tensor]:
    """5-bit codes [..., D] as the 40-bit columns' low 4 bytes [..., D / 2] and high byte [..., D / 8]."""
    if codes.shape[-1] % 8:
        raise ValueError(f"a row of {codes.shape[-1]} codes does not fill whole 40-bit columns of 5-bit "
                         "values")
    shifts = torch.arange(0, 40, 5, dtype=torch.int64, device=codes.device)
    column = ((codes.to(torch.int64) & 31).view(*codes.shape[:-1], -1, 8) << shifts).sum(-1)  # [..., D / 8]
    byte_shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=codes.device)
    low = ((column[..., None] >> byte_shifts) & 255).flatten(-2)
    return [low.to(torch.uint8), (column >> 32).to(torch.uint8)]


def _unpack_five_bit_columns(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    byte_shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=low.device)
    words = (low.to(torch.int64).view(*low.shape[:-1], -1, 4) << byte_shifts).sum(-1)
    column = words | (high.to(torch.int64) << 32)
    shifts = torch.arange(0, 40, 5, dtype=torch.int64, device=low.device)
    return ((column[..., None] >> shifts) & 31).flatten(-2).to(torch.uint8)


def record_codes(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Code rows [..., n, D * bits / 8] (encode_tiles' layout, n <= group) as a pool record of `group` rows
    (the module docstring; rows from n on are zero)."""
    rows = codes.shape[-2]
    if rows < group:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-2], group - rows, codes.shape[-1])], -2)
    if bits != 5:
        return codes
    if group % 8:
        raise ValueError(f"5-bit codes need tiles of a multiple of 8 rows, got {group}")
    low, high = codes[..., :codes.shape[-1] * 4 // 5], codes[..., codes.shape[-1] * 4 // 5:]
    grouped = high.reshape(*high.shape[:-2], group // 8, 8, high.shape[-1]).transpose(-1, -2)
    return torch.cat([low.flatten(-2), grouped.flatten(-3)], -1).view(codes.shape)


def row_codes(record: torch.Tensor, bits: int) -> torch.Tensor:
    """record_codes' inverse: a pool record [..., G, D * bits / 8] as code rows (encode_tiles' layout)."""
    if bits != 5:
        return record
    group, width = record.shape[-2:]
    flat = record.flatten(-2)
    low = flat[..., :group * width * 4 // 5].unflatten(-1, (group, width * 4 // 5))
    high = flat[..., group * width * 4 // 5:].unflatten(-1, (group // 8, width // 5, 8)).transpose(-1, -2)
    return torch.cat([low, high.flatten(-3, -2)], -1)


def fp8_scale(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The fp8_e4m3 scale that maps x's largest magnitude over `dims` to the format's largest finite value
    (448), kept fp32; where x is all zero, 1. (Storing and reading with a scale: attention/fp8.py.)"""
    amax = x.float().abs().amax(dim=dims, keepdim=True)
    return torch.where(amax > 0, amax / fp8.FP8_MAX, torch.ones_like(amax))


def rotate(x: torch.Tensor, matrix: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [..., D] @ matrix [D, D]. batch_invariant: each row by itself, one [1, D] x [D, D] product of one
    memory layout (a contiguous row; the matrix expanded without a copy), so that a row's bits never depend
    on how many rows or tiles the call holds (MKL picks its kernel, and so a sum's order, by the product's
    shape and layout; model/batch_invariant.py says what torch's CPU ops allow)."""
    if not batch_invariant:
        return x @ matrix
    rows = x.reshape(-1, 1, x.shape[-1]).contiguous()
    return torch.bmm(rows, matrix.expand(rows.shape[0], -1, -1)).view(*x.shape[:-1], matrix.shape[-1])


def encode_tiles(x: torch.Tensor, bits: int, keys: bool, rotation: torch.Tensor | None,
                 iterations: int = 8, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., G, D] as a pool block stores it: rotated (unless rotation is None) and quantized, the codes of
    each token row in bit planes, concatenated in PLANES order ([..., G, D * bits / 8] uint8), and the fp16
    scales in one row: keys channel scale [D], channel zero [D], token scale [G]; values channel scale [D],
    token scale [G], token zero [G] ([..., 2 D + G] or [..., D + 2 G]). batch_invariant: the rotation row by
    row (`rotate`)."""
    y = rotate(x.float(), rotation, batch_invariant) if rotation is not None else x.float()
    if batch_invariant:
        y = y.contiguous()  # the codec's reductions then see one layout, whatever the rows' strides
    if keys:
        q = quantize_keys(y, bits, iterations)
        scales = [q.channel_scale, q.channel_zero, q.token_scale]
    else:
        q = quantize_values(y, bits, iterations)
        scales = [q.channel_scale, q.token_scale, q.token_zero]
    return torch.cat(pack_codes(q.codes, bits), -1), torch.cat(scales, -1)


def decode_tiles(codes: torch.Tensor, scales: torch.Tensor, bits: int, keys: bool,
                 rotation: torch.Tensor | None, batch_invariant: bool = False) -> torch.Tensor:
    """What attention reads of tiles stored by encode_tiles: [..., G, D] fp32, rotated back (batch_invariant:
    row by row, so a tile reads the same bits decoded alone or among others)."""
    group = codes.shape[-2]
    head_dim = codes.shape[-1] * 8 // bits
    planes, first = [], 0
    for width in PLANES[bits]:
        planes.append(codes[..., first:first + head_dim * width // 8])
        first += head_dim * width // 8
    unpacked = unpack_codes(planes, bits)
    if keys:
        y = dequantize_keys(QuantizedKeys(unpacked, scales[..., :head_dim],
                                          scales[..., head_dim:2 * head_dim], scales[..., 2 * head_dim:]))
    else:
        y = dequantize_values(QuantizedValues(unpacked, scales[..., :head_dim],
                                              scales[..., head_dim:head_dim + group],
                                              scales[..., head_dim + group:]))
    return rotate(y, rotation.T, batch_invariant) if rotation is not None else y


def roundtrip(x: torch.Tensor, bits: int, keys: bool, rotation: torch.Tensor | None,
              iterations: int = 8, batch_invariant: bool = False) -> torch.Tensor:
    """x [..., G, D] through the codec and back, as a pool block keeps it (encode_tiles, decode_tiles): what
    attention reads of a packed tile."""
    return decode_tiles(*encode_tiles(x, bits, keys, rotation, iterations, batch_invariant), bits, keys,
                        rotation, batch_invariant)
