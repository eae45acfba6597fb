"""The description of one attention call, split into what the kernels compile and what they read.

A ``Problem`` is what validation makes of a call: shapes, dtype, device, scale, and the features of
the attention variant. Its *static* part (``Problem.static``: dtype, head dim, alignment, device and
the ``Variant``, i.e. which features are present) is the one compile key: the planner turns it
into kernel configurations, and the in-memory and on-disk kernel caches key on those. Its *runtime*
part (``Problem.params``: window sizes, the softcap, the ALiBi slopes) is handed to the kernels as
arguments, so a new value never recompiles anything.

A feature enters the kernels as a specification (``nbflash.kernels.variants`` builds the code for
it), never as a copy of a kernel. Causal attention is not a feature of its own: it is the window
(-1, 0), i.e. every key up to the query's diagonal.
"""

from typing import NamedTuple

from .kernels.philox import keep_scale, keep_threshold

# flash-attn's spelling of an unbounded side of the window.
UNBOUNDED = -1


class Variant(NamedTuple):
    """Which features the kernels compile in (the static part of a problem); their values are
    runtime arguments (``Problem.params``), in the order of ``PARAMS``."""

    window: bool = False  # keys outside a band around the diagonal are masked (causal is one)
    softcap: bool = False  # scores squashed to softcap * tanh(score / softcap)
    alibi: bool = False  # scores lowered by slope[b, h] * |i + seqlen_k - seqlen_q - j|
    bias: str = ""  # the element type of an additive bias tensor ('' for none): + bias[b, h, i, j]
    mask: bool = False  # a boolean tensor says which (b, h, i, j) are kept
    # The user's functions, by fingerprint (nbflash.kernels.variants.user_function): score_mod(score,
    # b, h, q_idx, kv_idx) -> score, its derivative for the backward, mask_mod(b, h, q_idx, kv_idx).
    score_mod: str = ""
    score_mod_grad: str = ""
    mask_mod: str = ""
    dropout: bool = False  # attention dropout, regenerated in the backward from (seed, counter)
    # A table classifies each (query tile, key tile) of mask_mod as empty (skipped), partial (the
    # element test) or full (no test): nbflash.block_mask.
    block_mask: bool = False
    # Packed variable-length sequences (flash_attn_varlen_func): a layout, not a mask. The arrays are
    # (total, heads, headdim) packs of the batch's sequences, and sequence b is rows cu_seqlens[b] ..
    # cu_seqlens[b + 1] - 1 (the offsets are runtime values); each block reads its sequence's
    # bounds (geometry.packed_sequence) and sees that sequence as a dense one.
    varlen: bool = False

    @property
    def score(self):
        """A feature changes the scores (the kernels then scale them before anything else)."""
        return bool(self.softcap or self.alibi or self.bias or self.score_mod)

    def param_names(self):
        """The runtime values the kernels take for this variant, in kernel-argument order."""
        return tuple(name for feature, names in PARAMS if getattr(self, feature) for name in names)


# Each feature's runtime values, in the order the kernels receive them (``Variant.param_names``),
# with their kernel types in ``nbflash.kernels.variants.PARAM_TYPES``.
PARAMS = (
    ("window", ("window_left", "window_right")),
    ("softcap", ("softcap",)),
    ("alibi", ("alibi_slopes",)),
    ("bias", ("bias",)),
    ("mask", ("mask",)),
    ("dropout", ("dropout_threshold", "dropout_scale", "seed_lo", "seed_hi")),
    ("block_mask", ("block_mask",)),
    ("varlen", ("cu_seqlens_q", "cu_seqlens_k")),
)


class Static(NamedTuple):
    """The part of a problem compiled code depends on (``Problem.static``): the planner's input,
    and through the configurations it plans, the key of every kernel cache."""

    dtype: str
    headdim: int
    aligned: bool
    device: int
    variant: Variant = Variant()
    # The tensor-core forward folds a positive scale into its exp2; any other scale is applied to
    # the scores first. Only the sign is static; the value stays a kernel argument.
    positive_scale: bool = True


class Problem(NamedTuple):
    """One attention call, after validation."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    dtype: str  # 'float16', 'bfloat16' or 'float32'
    softmax_scale: float
    aligned: bool  # every row of q, k and v starts on a 16-byte boundary (vector loads allowed)
    device: int  # the GPU the arrays live on (0 under the simulator)
    variant: Variant
    # The window, normalized (see ``window_bounds``): seqlen_k (left) or seqlen_q (right) where a
    # side masks nothing, so the kernels never meet -1.
    window_left: int
    window_right: int
    softcap: float = 0.0  # 0: none
    # float32 (batch, nheads), a view that may have stride 0 over batch; None: no ALiBi. An array, so
    # a problem with slopes is never remembered across calls (validation.check_forward).
    alibi_slopes: object = None
    # (batch, nheads, seqlen_q, seqlen_k) views (stride 0 where the caller's tensor broadcasts):
    # an additive float bias, a boolean mask (True = kept); None: none.
    bias: object = None
    mask: object = None
    dropout_p: float = 0.0
    seed: int = 0  # dropout's 64-bit Philox key
    # A nbflash.block_mask.BlockMask; each kernel reads its class table for its own tile sizes
    # (nbflash.block_mask.kernel_params puts that in place of this object).
    block_mask: object = None
    # Packed sequences: int32 (batch + 1,) offsets of each sequence's rows in q and in k / v; then
    # seqlen_q and seqlen_k are the callers' max_seqlen_q / max_seqlen_k (they size the grid) and
    # the window is normalized against them.
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None

    @property
    def dropout_threshold(self):
        """A score is kept iff its random byte is at least this (philox.keep_threshold): dropout_p
        is rounded to a multiple of 1/256."""
        return keep_threshold(self.dropout_p)

    @property
    def dropout_scale(self):
        """Kept probabilities are scaled by this: the exact inverse of the kept fraction
        (philox.keep_scale), 1 / (1 - dropout_p) for dropout_p a multiple of 1/256."""
        return keep_scale(self.dropout_p)

    @property
    def seed_lo(self):
        return self.seed & 0xFFFFFFFF

    @property
    def seed_hi(self):
        return (self.seed >> 32) & 0xFFFFFFFF

    @property
    def static(self):
        """What compiled code depends on (``Static``): the plans and kernel caches key on this."""
        return Static(self.dtype, self.headdim, self.aligned, self.device, self.variant, self.softmax_scale > 0)

    @property
    def params(self):
        """The variant's runtime values, as the kernels take them (a tuple argument)."""
        return tuple(getattr(self, name) for name in self.variant.param_names())

    def window(self):
        """(left, right) as flash-attn spells them: -1 for a side that masks nothing."""
        left = -1 if self.window_left >= self.seqlen_k else self.window_left
        right = -1 if self.window_right >= self.seqlen_q else self.window_right
        return left, right

    @property
    def causal(self):
        """Every key up to the diagonal and none after it."""
        return self.window_right == 0 and self.window_left >= self.seqlen_k


def window_bounds(seqlen_q, seqlen_k, causal, window_size):
    """flash-attn's (causal, window_size) as (left, right) the kernels can use directly.

    ``window_size = (left, right)``, -1 meaning unbounded; ``causal`` sets right to 0. A side that
    masks nothing for these lengths (left >= seqlen_k - 1, right >= seqlen_q - 1) becomes
    seqlen_k or seqlen_q, so that a window wider than the sequence runs the plain kernels.
    Returns (left, right, window) with ``window`` True when some key is masked by it.
    """
    left, right = window_size
    if causal:
        right = 0
    left_masks = 0 <= left < seqlen_k - 1
    right_masks = 0 <= right < seqlen_q - 1
    return (left if left_masks else seqlen_k), (right if right_masks else seqlen_q), left_masks or right_masks
