"""A small decoder-only transformer written with CuPy alone, generating text with nbflash.

Random weights (seeded), so the "text" is token ids; the point is the attention calls of a real
serving loop:

- prefill: all prompts (each of its own length) packed one after another, no padding, through
  ``flash_attn_varlen_func`` (causal per prompt); their rotated keys and values are written into a
  paged KV cache (pages of ``--page-size`` tokens, a block table per sequence);
- decode: all sequences at once, one token per step, ``flash_attn_with_kvcache`` appending the new
  token's key and value in place and attending to the whole cache (split-KV when the batch is small).

The model: token embedding, ``--layers`` blocks of (RMSNorm, grouped-query attention with rotary
embedding (GPT-NeoX pairs), RMSNorm, SwiGLU MLP), a final RMSNorm and the tied embedding as the output
layer. ``reference_logits`` is the same model in float64 NumPy with plain softmax attention: the test
(tests/test_generate.py) checks the CuPy model's logits against it.

    python scripts/generate.py --batch 8 --prompt-lengths 17 300 1000 --new-tokens 64

prints the tokens per second of the decode loop and attention's share of a decode step (CUDA events
around the attention calls). With no GPU, Numba's CUDA simulator runs it (``--tiny``): then the
times are the simulator's, not a GPU's.
"""

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402


class Config:
    def __init__(self, vocab=512, dim=256, layers=2, heads=8, kv_heads=2, hidden=512, max_len=2048, page_size=16,
                 dtype="float16", rope_base=10000.0):
        self.vocab, self.dim, self.layers, self.heads, self.kv_heads = vocab, dim, layers, heads, kv_heads
        self.hidden, self.max_len, self.page_size, self.dtype, self.rope_base = hidden, max_len, page_size, dtype, rope_base
        self.head_dim = dim // heads


def random_weights(config, seed=0):
    """float32 NumPy weights, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    d, hd = config.dim, config.head_dim

    def w(*shape):
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)

    layers = []
    for _ in range(config.layers):
        layers.append({
            "wq": w(d, config.heads * hd), "wk": w(d, config.kv_heads * hd), "wv": w(d, config.kv_heads * hd),
            "wo": w(config.heads * hd, d), "w_gate": w(d, config.hidden), "w_up": w(d, config.hidden),
            "w_down": w(config.hidden, d),
            "norm_attn": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
            "norm_mlp": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        })
    return {"embed": rng.standard_normal((config.vocab, d)).astype(np.float32), "layers": layers,
            "norm_out": (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)}


def cache_positions(config):
    """Positions a sequence's pages hold: max_len rounded up to whole pages."""
    return -(-config.max_len // config.page_size) * config.page_size


def rotary_tables(config):
    """cos, sin: (positions, head_dim / 2) for cache positions 0, 1, ... (float64)."""
    half = config.head_dim // 2
    frequencies = config.rope_base ** (-np.arange(half) / half)
    angles = np.arange(cache_positions(config))[:, None] * frequencies[None, :]
    return np.cos(angles), np.sin(angles)


# ---------------------------------------------------------------------------------------------------
# The model on the GPU (CuPy; NumPy arrays under the simulator) with nbflash's attention
# ---------------------------------------------------------------------------------------------------


class Model:
    def __init__(self, config, weights, xp):
        import nbflash

        self.nbflash, self.config, self.xp = nbflash, config, xp
        dtype = nbflash.dtypes.SUPPORTED[config.dtype]
        self.dtype = dtype
        to = lambda a: xp.asarray(a.astype(dtype))  # noqa: E731
        self.embed = to(weights["embed"])
        self.layers = [{name: to(value) for name, value in layer.items()} for layer in weights["layers"]]
        self.norm_out = to(weights["norm_out"])
        cos, sin = rotary_tables(config)
        self.cos, self.sin = to(cos), to(sin)
        self.attention_seconds = 0.0

    def new_cache(self, batch):
        """Per layer (k_cache, v_cache) of pages, and the block table: sequence b owns pages
        b * per_seq .. (b + 1) * per_seq - 1, handed out in a shuffled order (a real allocator's
        pages are anywhere)."""
        c, xp = self.config, self.xp
        per_seq = cache_positions(c) // c.page_size
        shape = (batch * per_seq, c.page_size, c.kv_heads, c.head_dim)
        caches = [(xp.zeros(shape, self.dtype), xp.zeros(shape, self.dtype)) for _ in range(c.layers)]
        order = np.random.default_rng(1).permutation(batch * per_seq).astype(np.int32)
        return caches, xp.asarray(order.reshape(batch, per_seq))

    def rms_norm(self, x, weight):
        xp = self.xp
        x32 = x.astype(xp.float32)
        scale = 1.0 / xp.sqrt((x32 * x32).mean(axis=-1, keepdims=True) + 1e-6)
        return (x32 * scale * weight.astype(xp.float32)).astype(self.dtype)

    def _block(self, layer, h, attend):
        """One transformer block on hidden states h (..., dim); ``attend(q, k, v)`` does attention on
        the block's projections (shaped (..., heads, head_dim)) and returns (..., heads, head_dim)."""
        xp, c = self.xp, self.config
        x = self.rms_norm(h, layer["norm_attn"])
        shape = h.shape[:-1]
        q = (x @ layer["wq"]).reshape(*shape, c.heads, c.head_dim)
        k = (x @ layer["wk"]).reshape(*shape, c.kv_heads, c.head_dim)
        v = (x @ layer["wv"]).reshape(*shape, c.kv_heads, c.head_dim)
        h = h + attend(q, k, v).reshape(*shape, c.heads * c.head_dim) @ layer["wo"]
        x = self.rms_norm(h, layer["norm_mlp"])
        gate = (x @ layer["w_gate"]).astype(xp.float32)
        up = (x @ layer["w_up"]).astype(xp.float32)
        return h + ((gate / (1 + xp.exp(-gate)) * up).astype(self.dtype) @ layer["w_down"])

    def logits(self, h):
        return (self.rms_norm(h, self.norm_out) @ self.embed.T).astype(self.xp.float32)

    def rotate(self, x, positions):
        """Rotary embedding (NeoX pairs) of x (tokens, heads, head_dim) at ``positions`` (tokens,),
        in float32, stored in the model's dtype (what flash_attn_with_kvcache does to new keys)."""
        xp, half = self.xp, self.config.head_dim // 2
        cos = self.cos[positions].astype(xp.float32)[:, None, :]
        sin = self.sin[positions].astype(xp.float32)[:, None, :]
        x1, x2 = x[..., :half].astype(xp.float32), x[..., half:].astype(xp.float32)
        return xp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(self.dtype)

    def prefill(self, prompts, caches, block_table):
        """Logits (float32, (total tokens, vocab)) of the prompts packed one after another; their
        rotated keys and values go into the caches at positions 0 .. len - 1 of each sequence."""
        xp, c, nbflash = self.xp, self.config, self.nbflash
        lengths = np.array([len(p) for p in prompts])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = xp.asarray(np.concatenate(prompts).astype(np.int32))
        sequence = np.repeat(np.arange(len(prompts)), lengths)
        positions = np.concatenate([np.arange(n) for n in lengths])
        table = _host(block_table)
        pages = xp.asarray(table[sequence, positions // c.page_size])
        rows = xp.asarray(positions % c.page_size)
        positions, cu_seqlens, longest = xp.asarray(positions), xp.asarray(offsets), int(lengths.max())
        h = self.embed[tokens]
        for layer, (k_cache, v_cache) in zip(self.layers, caches):

            def attend(q, k, v):
                q, k = self.rotate(q, positions), self.rotate(k, positions)
                k_cache[pages, rows], v_cache[pages, rows] = k, v
                return nbflash.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, longest, longest, causal=True)

            h = self._block(layer, h, attend)
        return self.logits(h)

    def decode_step(self, tokens, caches, block_table, lengths, timed=False):
        """Logits (float32, (batch, vocab)) of one new token per sequence (``tokens`` (batch,)),
        whose keys and values are appended to the caches after ``lengths`` (int32 (batch,)) tokens."""
        xp, nbflash = self.xp, self.nbflash
        h = self.embed[tokens][:, None]  # (batch, 1, dim)
        for layer, (k_cache, v_cache) in zip(self.layers, caches):

            def attend(q, k, v):
                start = time.perf_counter()
                out = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, self.cos, self.sin,
                                                      cache_seqlens=lengths, block_table=block_table, causal=True,
                                                      rotary_interleaved=False)
                if timed:
                    _synchronize(xp)
                    self.attention_seconds += time.perf_counter() - start
                return out

            h = self._block(layer, h, attend)
        return self.logits(h[:, 0])

    def generate(self, prompts, new_tokens):
        """Greedy decoding. ``prompts``: a list of int lists (any lengths). Returns (tokens per
        sequence, decode seconds, attention seconds within decode, and per sequence the float32
        logits each new token was chosen from)."""
        xp = self.xp
        batch = len(prompts)
        caches, table = self.new_cache(batch)
        lengths = np.array([len(p) for p in prompts], np.int32)
        logits = _host(self.prefill(prompts, caches, table))
        last_rows = np.cumsum(lengths) - 1  # each prompt's last token in the packed batch
        chosen_from = [[logits[row]] for row in last_rows]
        tokens = [list(p) + [int(np.argmax(c[0]))] for p, c in zip(prompts, chosen_from)]
        device_lengths = xp.asarray(lengths)
        self.attention_seconds = 0.0
        _synchronize(xp)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            step = xp.asarray(np.asarray([t[-1] for t in tokens], np.int32))
            last = _host(self.decode_step(step, caches, table, device_lengths, timed=True))
            device_lengths += 1
            for t, row, record in zip(tokens, last, chosen_from):
                t.append(int(np.argmax(row)))
                record.append(row)
        _synchronize(xp)
        return tokens, time.perf_counter() - start, self.attention_seconds, chosen_from


def _synchronize(xp):
    if xp.__name__ == "cupy":
        xp.cuda.get_current_stream().synchronize()


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


# ---------------------------------------------------------------------------------------------------
# The same model in float64 NumPy, for the test
# ---------------------------------------------------------------------------------------------------


def reference_logits(config, weights, tokens):
    """float64 logits (seqlen, vocab) of one sequence of ``tokens``, plain causal softmax attention."""
    cos, sin = rotary_tables(config)
    hd, half = config.head_dim, config.head_dim // 2
    group = config.heads // config.kv_heads
    n = len(tokens)

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * weight

    def rotate(x):  # x (n, heads, hd), NeoX pairs (d, d + half)
        c, s = cos[:n, None, :], sin[:n, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

    w = {k: v for k, v in weights.items() if k != "layers"}
    h = w["embed"].astype(np.float64)[tokens]
    for layer in weights["layers"]:
        layer = {k: v.astype(np.float64) for k, v in layer.items()}
        x = norm(h, layer["norm_attn"])
        q = rotate((x @ layer["wq"]).reshape(n, config.heads, hd))
        k = rotate((x @ layer["wk"]).reshape(n, config.kv_heads, hd))
        v = (x @ layer["wv"]).reshape(n, config.kv_heads, hd)
        out = np.empty_like(q)
        causal = np.tril(np.ones((n, n), bool))
        for head in range(config.heads):
            s = q[:, head] @ k[:, head // group].T / math.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, head // group]
        h = h + out.reshape(n, -1) @ layer["wo"]
        x = norm(h, layer["norm_mlp"])
        gate, up = x @ layer["w_gate"], x @ layer["w_up"]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ layer["w_down"]
    h = norm(h, w["norm_out"].astype(np.float64))
    return h @ w["embed"].astype(np.float64).T


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[17, 300, 1000],
                        help="prompt lengths, used in turn for the batch's sequences")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--tiny", action="store_true", help="a toy size that the CPU simulator runs in seconds")
    args = parser.parse_args(argv)

    from nbflash import runtime

    if not runtime.SIMULATOR and not runtime.gpu_present():
        sys.exit("no GPU found: run with NUMBA_ENABLE_CUDASIM=1 (and --tiny) to use Numba's CUDA simulator")
    if args.tiny:
        config = Config(vocab=64, dim=16, layers=1, heads=1, kv_heads=1, hidden=32, max_len=32, page_size=4,
                        dtype=args.dtype)
        prompts = [[3, 1, 4, 1, 5], [9, 2]][: max(1, min(args.batch, 2))]
        new_tokens = min(args.new_tokens, 3)
    else:
        lengths = [args.prompt_lengths[b % len(args.prompt_lengths)] for b in range(args.batch)]
        config = Config(vocab=32000, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                        hidden=4 * args.dim, max_len=max(lengths) + args.new_tokens, page_size=args.page_size,
                        dtype=args.dtype)
        rng = np.random.default_rng(2)
        prompts = [list(rng.integers(0, config.vocab, n)) for n in lengths]
        new_tokens = args.new_tokens
    xp = np if runtime.SIMULATOR else runtime.cupy()
    model = Model(config, random_weights(config), xp)
    tokens, seconds, attention, _ = model.generate(prompts, new_tokens)
    steps = new_tokens - 1
    where = "Numba's CUDA simulator on the CPU: these times are not GPU times" if runtime.SIMULATOR else "GPU"
    print(f"{len(prompts)} sequences, prompts of {sorted(set(len(p) for p in prompts))} tokens, {new_tokens} new tokens "
          f"each ({where})")
    if steps > 0:
        print(f"decode: {len(prompts) * steps / seconds:.1f} tokens/s, {1e3 * seconds / steps:.2f} ms a step, "
              f"attention {100 * attention / seconds:.0f}% of it")
    print("first sequence:", tokens[0][-new_tokens:])


if __name__ == "__main__":
    main()
