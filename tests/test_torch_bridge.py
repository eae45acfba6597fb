"""nbflash.torch: autograd through our kernels, against PyTorch's SDPA (math backend), and the fp8
forward through it, on the GPU (marked gpu); the wrapping of torch's stream for CuPy against a fake
CuPy module, anywhere."""

import contextlib
import copy
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}


def sdpa_math(q, k, v, softmax_scale=None, causal=False):
    """SDPA's math backend on (batch, seqlen, nheads, headdim) tensors, bottom-right causal, GQA by
    repeating k and v (autograd then sums their gradients over the group, as ours does)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[2] // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)))
    mask = None
    if causal:
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        mask = torch.arange(seqlen_k, device=q.device)[None, :] <= rows + seqlen_k - seqlen_q
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=softmax_scale)
    return out.transpose(1, 2)


def gradients(attention, q, k, v, dout, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, **kwargs)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "shape, causal",
    [
        ((2, 113, 203, 4, 4, 64), False),
        ((2, 203, 203, 6, 2, 40), True),
        ((1, 128, 1024, 4, 1, 128), True),  # MQA, seqlen_q < seqlen_k: bottom-right causal
        ((2, 257, 300, 2, 2, 256), False),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_gradients_match_sdpa_math(shape, causal, dtype, deterministic):
    """Ours against SDPA math in float64, under the numerics contract (flash-attn's rule): at most
    twice the error of a same-precision naive implementation (nbflash.reference's attention_naive
    and attention_naive_backward: every matmul rounded to the input dtype), plus a floor relative to
    the gradient's size. SDPA math in the input dtype is not that baseline: on CUDA it computes in
    float32 and rounds once (its fp16 error is about half an ulp of the largest gradient), so its
    error is only reported."""
    from nbflash.dtypes import as_numpy_dtype
    from nbflash.reference import attention_naive, attention_naive_backward
    from nbflash.torch import flash_attn_func

    batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim = shape
    generator = torch.Generator(device="cuda").manual_seed(0)

    def draw(*size):
        return torch.randn(*size, device="cuda", generator=generator).to(DTYPES[dtype])

    q = draw(batch, seqlen_q, nheads, headdim)
    k, v = draw(batch, seqlen_k, nheads_k, headdim), draw(batch, seqlen_k, nheads_k, headdim)
    dout = draw(batch, seqlen_q, nheads, headdim)
    ours = gradients(flash_attn_func, q, k, v, dout, causal=causal, deterministic=deterministic)
    theirs = gradients(sdpa_math, q, k, v, dout, causal=causal)
    exact = gradients(sdpa_math, *(x.double() for x in (q, k, v, dout)), causal=causal)
    host = [x.float().cpu().numpy().astype(as_numpy_dtype(dtype)) for x in (dout, q, k, v)]
    naive = [attention_naive(*host[1:], causal=causal), *attention_naive_backward(*host, causal=causal)]
    for name, a, b, ref, n in zip(("out", "dq", "dk", "dv"), ours, theirs, exact, naive):
        assert a.shape == ref.shape and a.dtype == DTYPES[dtype], name
        assert not a.isnan().any(), name
        error = (a.double() - ref).abs().max().item()
        sdpa_error = (b.double() - ref).abs().max().item()
        naive_error = abs(n.astype("float64") - ref.cpu().numpy()).max()
        budget = 2 * naive_error + FLOOR[dtype] * max(1.0, ref.abs().max().item())
        assert error <= budget, (f"{name}: error {error:.3g} > budget {budget:.3g} "
                                 f"(naive {naive_error:.3g}, SDPA math {sdpa_error:.3g})")


class TinyAttentionModel(torch.nn.Module):
    """One causal self-attention layer and a projection, as in a small transformer block."""

    def __init__(self, attention, dim=128, nheads=4, nheads_k=2):
        super().__init__()
        self.attention, self.nheads, self.nheads_k = attention, nheads, nheads_k
        self.headdim = dim // nheads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * nheads_k * self.headdim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        batch, seqlen, dim = x.shape
        q = self.q(x).view(batch, seqlen, self.nheads, self.headdim)
        k, v = self.kv(x).view(batch, seqlen, 2, self.nheads_k, self.headdim).unbind(2)  # strided views
        return self.out(self.attention(q, k, v, causal=True).reshape(batch, seqlen, dim))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_steps_match_sdpa(dtype):
    """A few Adam steps on the same model and data: our losses follow SDPA's."""
    from nbflash.torch import flash_attn_func

    torch.manual_seed(0)
    ours = TinyAttentionModel(flash_attn_func).cuda().to(DTYPES[dtype])
    theirs = copy.deepcopy(ours)
    theirs.attention = sdpa_math
    x = torch.randn(4, 97, 128, device="cuda", dtype=DTYPES[dtype])
    target = torch.randn(4, 97, 128, device="cuda", dtype=DTYPES[dtype])
    losses = {}
    for name, model in (("ours", ours), ("sdpa", theirs)):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(8):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for a, b in zip(losses["ours"], losses["sdpa"]):
        assert abs(a - b) <= tolerance * abs(b), (losses["ours"], losses["sdpa"])
    assert losses["ours"][-1] < losses["ours"][0]  # it trained


@pytest.mark.gpu
def test_runs_on_torch_current_stream():
    """Forward and backward are queued on torch's current stream: a side stream gives the same result."""
    from nbflash.torch import flash_attn_func

    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.float16)
    expected = gradients(flash_attn_func, q, k, v, dout, causal=True, deterministic=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = gradients(flash_attn_func, q, k, v, dout, causal=True, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_strided_views_and_broadcast_gradient():
    """Inputs as transposed views of (batch, heads, seq, dim) tensors, read in place; ``out.sum()``
    hands the backward a broadcast (stride-0) gradient, which the bridge makes readable."""
    from nbflash.torch import flash_attn_func

    base = torch.randn(1, 4, 64, 32, device="cuda", dtype=torch.float16, requires_grad=True)
    q = base.transpose(1, 2)
    flash_attn_func(q, q, q).sum().backward()
    expected = torch.autograd.grad(sdpa_math(q, q, q).sum(), base)[0]
    assert base.grad.shape == base.shape and not base.grad.isnan().any()
    assert (base.grad.float() - expected.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_nbflash_does_not_import_torch():
    code = "import sys, nbflash, nbflash.backward; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_in_place_and_matches_cupy(paged):
    """nbflash.torch.flash_attn_with_kvcache writes the new tokens into the torch caches themselves
    and gives the CuPy function's result; against SDPA's math backend on the updated cache."""
    import nbflash
    from nbflash.torch import flash_attn_with_kvcache

    torch.manual_seed(0)
    batch, nheads, nheads_k, headdim, capacity = 3, 16, 4, 64, 256
    q = torch.randn(batch, 1, nheads, headdim, device="cuda", dtype=torch.float16)
    k_new = torch.randn(batch, 1, nheads_k, headdim, device="cuda", dtype=torch.float16)
    v_new = torch.randn_like(k_new)
    lengths = torch.tensor([100, 0, 255], device="cuda", dtype=torch.int32)
    if paged:
        page = 16
        k_cache = torch.randn(batch * capacity // page, page, nheads_k, headdim, device="cuda", dtype=torch.float16)
        table = torch.randperm(batch * capacity // page, device="cuda").to(torch.int32).view(batch, -1)
    else:
        k_cache = torch.randn(batch, capacity, nheads_k, headdim, device="cuda", dtype=torch.float16)
        table = None
    v_cache = torch.randn_like(k_cache)
    out = torch.empty_like(q)
    result = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                     causal=True, out=out)
    assert result is out
    for b in range(batch):
        position = int(lengths[b])
        if paged:
            row, offset = int(table[b, position // page]), position % page
        else:
            row, offset = b, position
        assert torch.equal(k_cache[row, offset], k_new[b, 0]) and torch.equal(v_cache[row, offset], v_new[b, 0])
        seen = torch.arange(position + 1, device="cuda")
        if paged:
            k_b = k_cache[table[b, seen // page].long(), seen % page]
            v_b = v_cache[table[b, seen // page].long(), seen % page]
        else:
            k_b, v_b = k_cache[b, : position + 1], v_cache[b, : position + 1]
        expected = sdpa_math(q[b:b + 1].float(), k_b[None].float(), v_b[None].float())
        assert (out[b:b + 1].float() - expected).abs().max() < 2e-3
    # Same call through CuPy, on copies of the caches as they were updated: the same output.
    again = nbflash.flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), cache_seqlens=lengths + 1,
                                            block_table=table, causal=True)
    assert torch.equal(torch.from_dlpack(again), out)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradients_match_sdpa_math_per_sequence(dtype, causal):
    """flash_attn_varlen_func with autograd: each packed sequence against SDPA on that sequence
    alone (empty sequences among them; SDPA would give NaN to rows that see no key), GQA 2:1."""
    from nbflash.torch import flash_attn_varlen_func

    lengths_q, lengths_k = [37, 0, 130, 5], [50, 9, 140, 0]
    cu = [torch.tensor([0] + list(torch.tensor(n).cumsum(0)), dtype=torch.int32, device="cuda")
          for n in (lengths_q, lengths_k)]
    t = DTYPES[dtype]
    q = torch.randn(sum(lengths_q), 4, 64, device="cuda", dtype=t)
    k, v = (torch.randn(sum(lengths_k), 2, 64, device="cuda", dtype=t) for _ in range(2))
    dout = torch.randn_like(q)
    out, dq, dk, dv = gradients(flash_attn_varlen_func, q, k, v, dout, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1],
                                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=causal)
    tolerance = 2e-2 if dtype == "float16" else 6e-2
    for b in range(len(lengths_q)):
        rows_q = slice(int(cu[0][b]), int(cu[0][b + 1]))
        rows_k = slice(int(cu[1][b]), int(cu[1][b + 1]))
        if rows_q.start == rows_q.stop or rows_k.start == rows_k.stop:
            assert (out[rows_q] == 0).all() and (dk[rows_k] == 0).all() and (dv[rows_k] == 0).all()
            continue
        ref = gradients(sdpa_math, q[None, rows_q].float(), k[None, rows_k].float(), v[None, rows_k].float(),
                        dout[None, rows_q].float(), causal=causal)
        for mine, theirs in zip((out[rows_q], dq[rows_q], dk[rows_k], dv[rows_k]), ref):
            theirs = theirs[0]
            assert (mine.float() - theirs).abs().max().item() < tolerance * max(1.0, theirs.abs().max().item())


# --- torch's stream as CuPy's: Stream.from_external where CuPy has it (14 deprecates ExternalStream and
# warns on each one), else ExternalStream; against a fake CuPy module, so these run without a GPU ---------

class FakeTorchStream:
    """What nbflash reads of a torch stream: its pointer, and the CUDA stream protocol (recent torch)."""

    def __init__(self, pointer):
        self.cuda_stream = pointer

    def __cuda_stream__(self):
        return (0, self.cuda_stream)


class OldFakeTorchStream:
    """A torch stream from before the CUDA stream protocol: the pointer only."""

    def __init__(self, pointer):
        self.cuda_stream = pointer


def fake_cupy(from_external):
    """A CuPy module as nbflash.torch uses it, recording the streams it is asked to make and the ones
    entered. ExternalStream warns as CuPy 14's does where from_external exists (and not where it does not)."""
    made, entered = [], []

    class Wrapped:
        def __init__(self, how, pointer, device):
            self.how, self.pointer, self.device = how, pointer, device

        @contextlib.contextmanager
        def _entered(self):
            entered.append(self)
            yield self

        def __enter__(self):
            self._context = self._entered()
            return self._context.__enter__()

        def __exit__(self, *exc):
            return self._context.__exit__(*exc)

    class Stream:
        pass

    if from_external:
        def make_from_external(obj):
            version, pointer = obj.__cuda_stream__()
            assert version == 0
            made.append(Wrapped("from_external", pointer, -1))
            return made[-1]

        Stream.from_external = staticmethod(make_from_external)

    def external_stream(pointer, device_id=-1):
        if from_external:
            warnings.warn("ExternalStream is deprecated. Use Stream.from_external() instead", DeprecationWarning,
                          stacklevel=2)
        made.append(Wrapped("ExternalStream", pointer, device_id))
        return made[-1]

    cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=external_stream,
                                 Device=lambda device: contextlib.nullcontext())
    return types.SimpleNamespace(cuda=cuda), made, entered


class CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on cuda:1, to reach the stream wrapping without a GPU."""

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.mark.parametrize("protocol", [True, False], ids=["torch-stream-protocol", "older-torch"])
@pytest.mark.parametrize("from_external", [True, False], ids=["cupy-14", "older-cupy"])
def test_torch_stream_wrapped_without_deprecation_warning(monkeypatch, recwarn, from_external, protocol):
    import nbflash.torch as nbtorch
    from nbflash import runtime

    cupy, made, entered = fake_cupy(from_external)
    monkeypatch.setattr(runtime, "cupy", lambda: cupy)
    monkeypatch.setattr(nbtorch, "_CUPY_STREAMS", {})
    streams = {"main": (FakeTorchStream if protocol else OldFakeTorchStream)(0x1230),
               "side": (FakeTorchStream if protocol else OldFakeTorchStream)(0x4560)}
    current = {"stream": streams["main"]}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    q = torch.zeros(2).as_subclass(CudaLooking)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a DeprecationWarning raises here
        for name in ("main", "main", "side", "main"):
            current["stream"] = streams[name]
            with nbtorch._on_torch_stream(q):
                pass
    assert [w for w in recwarn.list if issubclass(w.category, DeprecationWarning)] == []
    how = "from_external" if from_external else "ExternalStream"
    # one wrapper per torch stream, made on first use and kept: the calls on main reuse its one
    assert [(m.how, m.pointer) for m in made] == [(how, 0x1230), (how, 0x4560)]
    assert [m.pointer for m in entered] == [0x1230, 0x1230, 0x4560, 0x1230]
    if not from_external:
        assert [m.device for m in made] == [1, 1]  # ExternalStream is told the tensor's device


def test_torch_streams_have_the_stream_protocol_here():
    """The torch installed here: its streams carry __cuda_stream__ (returning (0, pointer)), which
    Stream.from_external reads; older torch is served by nbflash.torch's own wrapper of the pointer."""
    if not hasattr(torch.cuda.Stream, "__cuda_stream__"):
        pytest.skip(f"torch {torch.__version__}'s streams lack __cuda_stream__")
    assert hasattr(torch.cuda.ExternalStream, "__cuda_stream__")


# --- the fp8 forward through nbflash.torch: float8_e4m3fn tensors, their bytes handed to CuPy as uint8 ---------

@pytest.mark.gpu
@pytest.mark.parametrize("descales", ["tensors", "scalars"])
def test_fp8_forward_matches_the_cupy_route(descales):
    """torch.float8_e4m3fn tensors give bit for bit what the CuPy route (the same bytes in uint8 CuPy
    arrays, fp8_dtype) gives, bfloat16 out and float32 lse, on torch's current stream; uint8 tensors
    with fp8_dtype too."""
    import cupy
    import ml_dtypes

    import nbflash
    from nbflash.torch import flash_attn_func

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fp8 forward runs on compute capability 9.0 only")
    rng = np.random.default_rng(7)
    host = [rng.standard_normal((2, n, h, 128)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            for n, h in ((113, 4), (203, 2), (203, 2))]
    if descales == "tensors":
        scales = [rng.uniform(0.25, 2.0, (2, 2)).astype(np.float32) for _ in range(3)]
        torch_scales = [torch.from_numpy(d).cuda() for d in scales]
        cupy_scales = [cupy.asarray(d) for d in scales]
    else:
        torch_scales = cupy_scales = [0.5, 1.5, 0.75]
    names = ("q_descale", "k_descale", "v_descale")
    expected_out, expected_lse = nbflash.flash_attn_func(
        *(cupy.asarray(x.view(np.uint8)) for x in host), causal=True, return_lse=True, fp8_dtype="float8_e4m3fn",
        **dict(zip(names, cupy_scales)))
    tensors = [torch.from_numpy(x.view(np.uint8)).cuda().view(torch.float8_e4m3fn) for x in host]
    out, lse = flash_attn_func(*tensors, causal=True, return_lse=True, **dict(zip(names, torch_scales)))
    assert out.dtype == torch.bfloat16 and out.shape == tensors[0].shape and lse.dtype == torch.float32
    assert torch.equal(out.view(torch.int16).cpu(), torch.from_numpy(expected_out.get().view(np.int16)))
    assert torch.equal(lse.cpu(), torch.from_numpy(expected_lse.get()))
    out_bytes = flash_attn_func(*(x.view(torch.uint8) for x in tensors), causal=True, fp8_dtype="float8_e4m3fn",
                                **dict(zip(names, torch_scales)))
    assert torch.equal(out_bytes.view(torch.int16), out.view(torch.int16))
