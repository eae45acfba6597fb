"""The KV cache's small kernels: the in-place append (with rotary embedding), the split-KV combine,
and the merge of two attention states. Scalar code, any element type, memory-bound and tiny next
to the attention itself.

append:   k_cache/v_cache rows at positions cache_len_b .. cache_len_b + seqlen_new - 1 of sequence b
          <- the new k (rotated when rotary is on) and v; contiguous or paged like the decode kernel.
          A position past the cache's capacity, or a page index outside the cache, is skipped: the
          kernel never writes outside the cache, whatever the lengths and block table say.
combine:  the splits' partial outputs o_s (normalized) and log-sum-exps lse_s of each row:
              lse = log(sum_s exp(lse_s)),   out = sum_s exp(lse_s - lse) o_s
merge:    the same for two states (out_a, lse_a), (out_b, lse_b) given by the caller (cascade and
          shared-prefix attention: nbflash.merge_attention_states).
A state whose lse is -inf (a split or a row that saw no key) has weight 0; a row whose every state
is -inf gets out 0 and lse -inf.
"""

import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda, float32

from .tiles import element_io

NEG_INF = float32(-math.inf)


@dataclass(frozen=True)
class AppendConfig:
    """The append kernel for one element type and cache layout."""

    dtype: str  # 'float16', 'bfloat16' or 'float32'
    paged: bool = False
    rotary: bool = False
    rotary_interleaved: bool = True
    threads: int = 128

    dynamic_shared_bytes = 0

    @staticmethod
    def grid(batch, seqlen_new, nheads_k):
        return (batch * seqlen_new * nheads_k, 1, 1)


def make_append_rows(dtype, paged, rotary, interleaved):
    """The append as a device function, for the append kernel and for the decode kernel that fuses
    it (decode_mma.py, ``append``): ``append_rows(k_cache, v_cache, k, v, b, hk, cache_len, i_lo,
    i_hi, cache_row, block_table, rotary_cos, rotary_sin, first, step)`` writes new tokens i_lo ..
    i_hi - 1 of sequence b, KV head hk, at cache positions cache_len + i, its elements shared among
    threads (this one's: first, first + step, ...). ``cache_row``: the contiguous cache's row of b."""
    load, store = element_io(dtype)

    @cuda.jit(device=True, inline=True)
    def rotated(x, b, i, hk, col, rotary_dim, cos_row, rotary_cos, rotary_sin):
        """Element ``col`` of a row after rotary embedding: pairs (2d, 2d + 1) when interleaved, else
        (d, d + rotary_dim / 2), each turned by the angle of frequency d; columns past rotary_dim
        pass through."""
        value = load(x[b, i, hk, col])
        if col >= rotary_dim:
            return value
        half = rotary_dim // 2
        if interleaved:
            d, first = col // 2, col % 2 == 0
            partner = col + 1 if first else col - 1
        else:
            first = col < half
            d = col if first else col - half
            partner = col + half if first else col - half
        other = load(x[b, i, hk, partner])
        c = load(rotary_cos[cos_row, d])
        s = load(rotary_sin[cos_row, d])
        return value * c - other * s if first else other * s + value * c

    @cuda.jit(device=True, inline=True)
    def append_rows(k_cache, v_cache, k, v, b, hk, cache_len, i_lo, i_hi, cache_row, block_table, rotary_cos,
                    rotary_sin, first, step):
        headdim = k.shape[3]
        capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
        rotary_dim = 2 * rotary_cos.shape[1] if rotary else 0
        for item in range(i_lo * headdim + first, i_hi * headdim, step):
            i, col = item // headdim, item % headdim
            position = cache_len + i
            if position < 0 or position >= capacity:
                continue  # overflow: nothing is written outside the cache
            if paged:
                row = block_table[b, position // k_cache.shape[1]]
                offset = position % k_cache.shape[1]
            else:
                row, offset = cache_row, position
            if row < 0 or row >= k_cache.shape[0]:
                continue  # a page (or a batch index) outside the cache
            if rotary:
                cos_row = min(position, rotary_cos.shape[0] - 1)
                k_cache[row, offset, hk, col] = store(rotated(k, b, i, hk, col, rotary_dim, cos_row, rotary_cos,
                                                              rotary_sin))
            else:
                k_cache[row, offset, hk, col] = k[b, i, hk, col]
            v_cache[row, offset, hk, col] = v[b, i, hk, col]

    return append_rows


@lru_cache(maxsize=None)
def build_append(config: AppendConfig):
    THREADS = config.threads
    HAS_BATCH_IDX = 1  # options bit, as in decode_mma
    append_rows = make_append_rows(config.dtype, config.paged, config.rotary, config.rotary_interleaved)

    @cuda.jit
    def append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
               fixed_len, options):
        seqlen_new, nheads_k = k.shape[1], k.shape[2]
        item = cuda.blockIdx.x
        b = item // (seqlen_new * nheads_k)
        i = (item // nheads_k) % seqlen_new
        hk = item % nheads_k
        cache_len = fixed_len if fixed_len >= 0 else cache_seqlens[b]
        cache_row = cache_batch_idx[b] if options & HAS_BATCH_IDX else b
        append_rows(k_cache, v_cache, k, v, b, hk, cache_len, i, i + 1, cache_row, block_table, rotary_cos,
                    rotary_sin, cuda.threadIdx.x, THREADS)

    return append


@dataclass(frozen=True)
class CombineConfig:
    """The two-state merge (``kernel='merge'``, merge_attention_states). The split-KV combine of
    a decode step runs inside the decode kernel (decode_mma.merge_splits)."""

    kernel: str
    dtype: str
    threads: int = 128

    dynamic_shared_bytes = 0

    @staticmethod
    def grid(batch, nheads, seqlen_q):
        return (batch * nheads * seqlen_q, 1, 1)


@lru_cache(maxsize=None)
def build_combine(config: CombineConfig):
    THREADS = config.threads
    load, store = element_io(config.dtype)

    @cuda.jit(device=True, inline=True)
    def weights_base(lse_max):
        return lse_max if lse_max != NEG_INF else float32(0)

    @cuda.jit
    def merge(out_a, lse_a, out_b, lse_b, out, lse):
        """(out, lse) of the union of two key sets from each one's (out, lse)."""
        nheads, seqlen_q, headdim = lse.shape[1], lse.shape[2], out.shape[3]
        item = cuda.blockIdx.x
        b, h, i = item // (nheads * seqlen_q), (item // seqlen_q) % nheads, item % seqlen_q
        la, lb = lse_a[b, h, i], lse_b[b, h, i]
        m = weights_base(max(la, lb))
        wa, wb = math.exp(la - m), math.exp(lb - m)
        total = wa + wb
        inv_total = float32(1) / total if total != float32(0) else float32(0)
        for col in range(cuda.threadIdx.x, headdim, THREADS):
            o = (wa * load(out_a[b, i, h, col]) + wb * load(out_b[b, i, h, col])) * inv_total
            out[b, i, h, col] = store(o)
        if cuda.threadIdx.x == 0:
            lse[b, h, i] = m + math.log(total) if total != float32(0) else NEG_INF

    return merge

