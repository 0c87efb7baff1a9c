"""int8 (and int4, fp8) allreduce: a quantized reduce-scatter, an fp32 sum, a quantized all-gather.

Why not "quantize, then allreduce". Eight bits cannot hold a sum: two ranks at +127 already
overflow int8, and widening the wire to hold n ranks' sums (int16, int32) gives back the
bytes. Scaling every rank down by n so the integer sum fits (an agreed scale of
max|x| * n / 127) keeps 1 byte but throws away log2(n) of the 8 bits. So no integer sum is
ever taken here. The flat tensor is cut into one *chunk* per rank; rank r *owns* chunk r:

1. each rank adds its residual, quantizes every chunk (per *block* of ``block`` elements: a
   float32 scale ``max|x| / QMAX`` and one byte per element), and sends chunk j to rank j
   (alltoall);
2. the owner dequantizes the ``size`` versions of its chunk and sums them in float64 (the
   sum of n values each at most float32's max cannot overflow float64; an average of them
   is again a float32), divides by n for an average, adds its own *owner residual*, and
   quantizes the result again, with fresh scales;
3. every rank gathers the owners' quantized chunks (all-gather) and dequantizes them: the
   same bytes and scales on every rank, so the same result, bit for bit.

Overflow is impossible by construction: the only arithmetic on quantized values is
``q * scale`` in float32 with ``|q| <= QMAX`` and ``scale = max|x| / QMAX``, which is at most
``max|x|``; sums are float64. (An op=Sum whose result passes float32's range comes back NaN
where a float32 allreduce gives inf; GradScaler skips a step on either.) Error feedback
happens twice: each rank keeps what its own quantization lost (``residual``, the whole flat
size), and each owner what its second quantization lost (``owner``, its chunk), as
DoubleSqueeze and 1-bit Adam do, so both roundings are paid back at the next step.

Worked example, 2 ranks, 6 elements, block 3: chunks [0:3] (owner 0) and [3:6] (owner 1).
Rank 0 has x = [1.27, -0.5, 0, 2.54, 0, 0]: chunk 0's scale is 0.01 and its bytes [127, -50,
0]; chunk 1's scale 0.02, bytes [127, 0, 0]. Rank 1 sends rank 0 its chunk 0 the same way;
rank 0 sums the two dequantized chunks, re-quantizes, and both ranks gather the two chunks.

Bytes on the wire per element of the tensor, per rank, with n ranks and blocks of b
elements: the alltoall sends (n-1)/n of the chunks (by the pairwise exchange; Bruck's, which
``comm.py`` chooses among many ranks, about (log2 n)/2 times that), the all-gather one chunk
to each of n-1 ranks ((n-1)/n again, by the ring or Bruck's), each chunk 1 byte per element
plus 4 bytes per block: 2 (n-1)/n (1 + 4/b) bytes, against 2 (n-1)/n * 4 for a float32 ring allreduce
(about 3.97x fewer with b = 1024). A tensor shorter than n * b gets smaller blocks (one per
chunk), so tiny tensors never pay for a padded block; padding is at most one block per chunk.

int4 (``Int4``): the same schedule with codes -7..7 (scale ``max|x| / 7``) packed two to a
byte, 2 (n-1)/n (1/2 + 4/b) bytes per element, about 7.9x fewer than float32 with b = 1024. Its
roundings are coarse, and the two error feedbacks pay them back: on ``gradsync bench
compress``'s language model it reaches the target in as many steps as int8
(docs/slow-links.md, "The compressors").

fp8 (``FP8``): the same schedule with e4m3 bytes (scale ``max|x| / 448``): torch 2.x's CPU
kernels convert float32 to ``torch.float8_e4m3fn`` and back (nothing else is needed: the
sums are float64 here), with 3 mantissa bits against int8's 7 but a floating exponent inside
each block (small values next to large ones keep relative precision).

The arithmetic. int8, int4 and bf16 run their per-block parts (quantize with what the
rounding lost, the owner's float64 sum, the decode) as compiled kernels, one pass each
(``_quantfast.c``, installed or built by ``_native.py``), the same bits as the torch
operations below, which run where the kernels are not there (no compiler) and for fp8. As
torch operations they are a chain of whole-tensor passes: one rank's int4 reduction of a
3 MB bucket took 11-20 ms of one core (15-26 ns an element, more than a 1 Gbit/s link takes
to carry its bytes), compiled 4.5-6.5 ms; docs/benchmarks.md ("The quantizers compiled") has
the figures and the command.
"""

from __future__ import annotations

import torch

from .. import _native
from ..config import setting
from .base import ReducingCompressor

__all__ = ["Int8", "Int4", "FP8", "BF16"]

COMPILED = bool(setting("quant_fast"))
"""Whether int8, int4 and bf16 use the compiled kernels where they load (``quant_fast``:
``GRADSYNC_QUANT_FAST=0`` keeps torch's operations, for a comparison or to rule the kernels
out; the tests compare both paths by turning it off)."""


def _kernels():
    """The compiled kernels' module, or None (not wanted, or not there: ``_native``)."""
    return _native.load("_quantfast") if COMPILED else None


class _Quantized(ReducingCompressor):
    """The schedule of the module docstring; subclasses choose the byte encoding."""

    name = ""
    QMAX = 1.0
    WIDTH = 1
    """Bytes per element on the wire (``row_bytes`` for codes narrower than a byte)."""
    KIND: int | None = None
    """The compiled kernels' code for this encoding (``_quantfast.c``: 0 int8, 1 int4, 2
    bf16); None: torch's operations only."""

    def __init__(self, block: int = 1024, seed: int = 0, tiers: str = "slowest"):
        super().__init__(seed, tiers)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.block = block

    def _describe(self) -> str:
        return f"{self.name}(block={self.block})"

    def row_bytes(self, block: int) -> int:
        """Bytes on the wire for the codes of one block of ``block`` elements."""
        return block * self.WIDTH

    # -- encoding: float32 blocks (rows) <-> rows of ``row_bytes(block)`` bytes
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, q: torch.Tensor, block: int) -> torch.Tensor:
        raise NotImplementedError

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``x`` (rows) -> (scales float32 per row, uint8 rows of ``row_bytes``)."""
        scales = x.abs().amax(dim=1) / self.QMAX if x.numel() else x.new_zeros(x.shape[0])
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        return scales, self._encode(x / safe.unsqueeze(1))

    def _dequantize(self, scales: torch.Tensor, q: torch.Tensor, block: int) -> torch.Tensor:
        return self._decode(q, block) * scales.unsqueeze(1)

    def _fast(self):
        return _kernels() if self.KIND is not None else None

    def _quantize_kept(self, rows: torch.Tensor, keep: bool):
        """``_quantize(rows)`` and, where ``keep``, what it lost (``rows`` less what the codes
        give back; non-finite values zero: a gradient that overflowed must not poison later
        steps through a residual), else None."""
        fast = self._fast()
        if fast is None:
            scales, q = self._quantize(rows)
            lost = None
            if keep:
                sent = self._dequantize(scales, q, rows.shape[1])
                lost = torch.nan_to_num(rows - sent, nan=0.0, posinf=0.0, neginf=0.0)
            return scales, q, lost
        rows = rows.contiguous()
        count, block = rows.shape
        scales = torch.empty(count, dtype=torch.float32)
        q = torch.empty(count, self.row_bytes(block), dtype=torch.uint8)
        lost = torch.empty_like(rows) if keep else None
        fast.quantize(self.KIND, count, block, rows.data_ptr(), scales.data_ptr(),
                      q.data_ptr(), None if lost is None else lost.data_ptr())
        return scales, q, lost

    def _values(self, scales: torch.Tensor, q: torch.Tensor, block: int,
                total: torch.Tensor | None = None) -> torch.Tensor:
        """``_dequantize``'s float32 values, or, given ``total`` (float64, rows x block),
        ``total`` with them added, each widened to float64."""
        fast = self._fast()
        if fast is None:
            values = self._dequantize(scales, q, block)
            return values if total is None else total.add_(values.double())
        scales, q = scales.contiguous(), q.contiguous()
        count = scales.numel()
        if total is not None:
            fast.dequantize(self.KIND, count, block, scales.data_ptr(), q.data_ptr(), None,
                            total.data_ptr())
            return total
        out = torch.empty(count, block, dtype=torch.float32)
        fast.dequantize(self.KIND, count, block, scales.data_ptr(), q.data_ptr(),
                        out.data_ptr(), None)
        return out

    def layout(self, numel: int, size: int) -> tuple[int, int]:
        """(elements per block, blocks per chunk) for ``numel`` elements over ``size`` ranks."""
        per_rank = -(-numel // size)
        block = max(1, min(self.block, per_rank))
        return block, -(-per_rank // block)

    def _reduce(self, x, shapes, comm, key, average):
        numel, n = x.numel(), comm.size
        if numel == 0:
            return x
        block, blocks = self.layout(numel, n)
        chunk = block * blocks
        # Padding is zeros: it quantizes to zero bytes and sums to zero.
        padded = torch.empty(n * chunk, dtype=torch.float32)
        padded[numel:].zero_()
        since = self.state.begin()
        torch.add(x, self._residual(key, "residual", numel), out=padded[:numel])
        rows = padded.view(n * blocks, block)
        # What this rank's quantization lost stays here (non-finite values zero).
        scales, q, lost = self._quantize_kept(rows, keep=True)
        assert lost is not None
        residual = lost.reshape(-1)[:numel]  # a view: the padding it keeps is a block a chunk
        # Wire block for rank j: its chunk's scales (4 bytes each), then its bytes.
        codes = blocks * self.row_bytes(block)  # bytes of one chunk's codes
        wire = torch.cat([scales.view(n, blocks).view(torch.uint8),
                          q.reshape(n, codes)], dim=1)
        got = comm.alltoall(wire.reshape(-1)).view(n, 4 * blocks + codes)
        their_scales = _packed(got[:, :4 * blocks]).view(torch.float32)  # (n, blocks)
        their_q = _packed(got[:, 4 * blocks:])
        # The owner's sum, in float64 (module docstring: overflow is impossible).
        total = torch.zeros(blocks, block, dtype=torch.float64)
        for s in range(n):  # in rank order: the same rounding on every owner
            self._values(their_scales[s], their_q[s].view(blocks, -1), block, total)
        if average:
            total /= n
        mine = total.float()
        owner_name = f"owner{comm.rank}of{n}"
        if key is not None:
            mine += self.state.tensor(key, owner_name, (blocks, block))
        out_scales, out_q, owner = self._quantize_kept(mine, keep=key is not None)
        piece = torch.cat([out_scales.view(torch.uint8), out_q.view(-1).view(torch.uint8)])
        gathered = comm.allgather(piece).view(n, 4 * blocks + codes)
        # Every collective returned: only now does the state move (a reduction that a lost
        # peer cut short leaves it as it was, state.py).
        if key is not None:
            self.state.put(key, "residual", residual, since)
            self.state.put(key, owner_name, owner, since)
        all_scales = _packed(gathered[:, :4 * blocks]).view(torch.float32).reshape(-1)
        all_q = _packed(gathered[:, 4 * blocks:]).view(n * blocks, -1)
        out = self._values(all_scales, all_q, block).reshape(-1)
        return out[:numel].clone() if out.numel() > numel else out


def _packed(columns: torch.Tensor) -> torch.Tensor:
    """A copy of some columns of the wire's rows, packed row after row. Not
    ``contiguous()``: with one row (one rank) that returns the slice itself, whose row
    stride is the wire's, and a view of its bytes as float32 fails when that stride is not
    a multiple of 4 (an odd chunk of bf16 or int8 codes)."""
    return columns.clone(memory_format=torch.contiguous_format)


class Int8(_Quantized):
    """int8 with per-block scales, summed in float64 by each chunk's owner (module docstring).

    Args:
        block: elements per scale (4 bytes of scale per block on the wire).
        seed: unused by the arithmetic (int8 rounds to nearest); kept for the common state.
        tiers: ``"slowest"`` (default): on several hosts, only what crosses between hosts
            is quantized, once per host (``tiers.py``); ``"all"``: every rank's gradient.
    """

    name = "int8"
    QMAX = 127.0
    KIND = 0

    def _encode(self, x):
        return x.round().clamp_(-127, 127).to(torch.int8).view(torch.uint8)

    def _decode(self, q, block):
        return q.view(torch.int8).to(torch.float32)


class Int4(_Quantized):
    """int4 with per-block scales: codes -7..7, two to a byte (the high nibble first), summed
    in float64 by each chunk's owner (module docstring); same arguments as ``Int8``. A block of
    an odd number of elements ends with half a byte of padding."""

    name = "int4"
    QMAX = 7.0
    KIND = 1

    def row_bytes(self, block):
        return (block + 1) // 2

    def _encode(self, x):
        codes = (x.round().clamp_(-7, 7) + 8).to(torch.uint8)  # 1..15; 8 is zero
        if codes.shape[1] % 2:
            codes = torch.cat([codes, codes.new_full((codes.shape[0], 1), 8)], dim=1)
        return (codes[:, 0::2] << 4) | codes[:, 1::2]

    def _decode(self, q, block):
        codes = torch.stack([q >> 4, q & 15], dim=2).view(q.shape[0], -1)[:, :block]
        return codes.to(torch.float32) - 8.0


class FP8(_Quantized):
    """float8 e4m3 with per-block scales (module docstring); same arguments as ``Int8``."""

    name = "fp8"
    QMAX = 448.0

    def _encode(self, x):
        return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)

    def _decode(self, q, block):
        return q.view(torch.float8_e4m3fn).to(torch.float32)


class BF16(_Quantized):
    """bfloat16 on the wire (2 bytes per element), summed in float64 by each chunk's owner,
    with error feedback: the schedule of the module docstring with a wider code. bfloat16
    has float32's exponent, so the per-block scale only keeps the schedule common (4 bytes
    per ``block`` elements); unlike a cast around an allreduce (``Compression.bf16``), no sum
    is ever taken in 16 bits and what each rounding lost is sent at the next step. The
    candidate ``compression="auto"`` weighs against int8 (``auto.py``)."""

    name = "bf16"
    WIDTH = 2
    KIND = 2

    def _encode(self, x):
        return x.to(torch.bfloat16).view(torch.uint8)

    def _decode(self, q, block):
        return q.view(torch.bfloat16).to(torch.float32)
