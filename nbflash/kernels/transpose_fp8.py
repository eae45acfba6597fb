"""The fp8 forward's V operand: V^T, made on the GPU before each fp8 launch.

wgmma reads 8-bit operands K-major only, so for O = P V the fp8 forward (forward_sm90.py) takes V
with its keys contiguous:

    v   (batch, seqlen_k, nheads_k, headdim)           e4m3 bytes, any strides, rows contiguous
    vt  (batch, nheads_k, headdim, seqlen_k up to 16)  vt[b, h, d, p] = v[b, key(p), h, d]

where the keys of each 16 come in ``FP8_KEY_ORDER``: position 4 q + 2 c + e of a 16 holds key
8 c + 2 q + e, and positions past seqlen_k hold zeros.

One block moves a tile of 64 keys x 64 columns of one (batch, KV head) through shared memory:
each thread reads its four 32-bit words of V's rows (4 columns a word) into registers, all four
loads in flight at once, and stores them whole into the tile; then it writes V^T's rows as 32-bit
words (4 positions a word), each gathered from the bytes of four tile words. Both sides of global
memory go in whole consecutive words across a warp, so the transpose costs one read and one write
of V. A copy is bound by how many bytes are in flight: the first form of this kernel, one load at
a time into a byte tile, moved V at 850 GB/s on the H100, a quarter of its memory bandwidth
(docs/perf-notes.md, "The fp8 forward measured"); this one, at 128 threads a block (8 words a
thread), 1.26-1.32 TB/s, and at 256 threads 1.09-1.10 TB/s (scripts/fp8_parts.py --vt-threads 256
128, the fp8 shapes of hd 64 and 128, 4k and 16k: 51-53 us against 61-62 us; docs/perf-notes.md,
"Step 40 measured and planned; the V^T kernel, ...").
"""

from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, uint32

from .forward_sm90 import FP8

TILE = 64  # keys (and columns) a block moves
WORDS = TILE // 4  # 32-bit words in one row of the tile
PITCH = WORDS + 1  # words between the shared tile's rows: a row's words fall 1 bank apart from the last's


@dataclass(frozen=True)
class Fp8TransposeConfig:
    """The V^T kernel of the fp8 forward (one for every shape)."""

    dtype: str = FP8
    threads: int = 128  # 1.16-1.21x faster than 256 on an H100 (the module docstring)

    dynamic_shared_bytes = 0

    def __post_init__(self):
        if self.threads % WORDS or TILE % (self.threads // WORDS):
            raise ValueError(f"{self.threads=} must be a multiple of {WORDS} whose rows ({self.threads} / {WORDS}) "
                             f"divide the tile's {TILE}")

    @staticmethod
    def grid(batch, nheads_k, headdim, padded):
        """One block per (batch, KV head, 64-key tile) along x, one per 64 columns along y."""
        return (batch * nheads_k * -(-padded // TILE), -(-headdim // TILE), 1)


@lru_cache(maxsize=None)
def build_transpose_fp8(config: Fp8TransposeConfig):
    ROWS = config.threads // WORDS  # tile rows one pass of the block covers
    PASSES = TILE // ROWS  # the words a thread reads (and writes)

    @cuda.jit
    def transpose_v(v, vt):
        """v: (batch, seqlen_k, nheads_k, headdim / 4) uint32, 4 columns a word;
        vt: (batch, nheads_k, headdim, padded / 4) uint32, 4 positions a word."""
        tile = cuda.shared.array((TILE, PITCH), uint32)  # [key][word of 4 columns]
        seqlen_k, nheads_k, words = v.shape[1], v.shape[2], v.shape[3]
        headdim, padded = vt.shape[2], 4 * vt.shape[3]
        key_tiles = (padded + TILE - 1) // TILE
        block = cuda.blockIdx.x
        key0 = (block % key_tiles) * TILE
        hk = (block // key_tiles) % nheads_k
        b = block // (key_tiles * nheads_k)
        col0 = cuda.blockIdx.y * TILE
        w = cuda.threadIdx.x % WORDS
        first_row = cuda.threadIdx.x // WORDS

        # V's rows into the tile: row r is key key0 + r, its word w columns 4 w .. 4 w + 3; every
        # load is issued before the first store (keys past seqlen_k are zeros)
        x = cuda.local.array(PASSES, uint32)
        for i in range(PASSES):
            r = first_row + i * ROWS
            x[i] = uint32(0)
            if key0 + r < seqlen_k and col0 // 4 + w < words:
                x[i] = v[b, key0 + r, hk, col0 // 4 + w]
        for i in range(PASSES):
            tile[first_row + i * ROWS, w] = x[i]
        cuda.syncthreads()

        # V^T's rows from the tile: row r is column col0 + r (byte r % 4 of tile word r // 4), its
        # word w positions 4 w .. 4 w + 3 of the tile, which are positions 4 q + 2 c + e (q = w % 4)
        # of the 16 starting at 16 (w // 4)
        for i in range(PASSES):
            r = first_row + i * ROWS
            if col0 + r < headdim and key0 + 4 * w < padded:
                q = w % 4
                first = 16 * (w // 4)
                shift = uint32(8 * (r % 4))
                y = uint32(0)
                for c in range(2):
                    for e in range(2):
                        key = first + 8 * c + 2 * q + e
                        y |= ((tile[key, r // 4] >> shift) & uint32(0xFF)) << uint32(8 * (2 * c + e))
                vt[b, hk, col0 + r, (key0 + 4 * w) // 4] = y

    return transpose_v
