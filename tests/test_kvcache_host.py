"""flash_attn_with_kvcache's GPU host path without a GPU: a fake CuPy and a fake driver that records
what each launch hands the driver (scripts/host_profile_fake.py). The remembered-call fast path
skips validation and planning; these tests hold it to launching each call's own arrays, lengths and
stream, to the workspace of that stream, and to falling back to the full check (and its errors)
whenever anything the plan depends on differs."""

import os
import sys

import numpy as np
import pytest

import nbflash
from nbflash import kvcache, launch
from nbflash.kernels import registry

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from host_profile_fake import FakeArray, FakeMemory, FakeStream, decode_case, fake_gpu  # noqa: E402


def pointers(seen, config):
    """The data pointers of one recorded launch of ``config``'s kernel, in signature order."""
    _, _, words = seen
    return [words[w] for w in launch._pointer_words(registry.signature(config))]


def scalars(seen, config):
    """The trailing int32 scalar words of a recorded launch (fixed_len, options, ...), low 32 bits."""
    _, _, words = seen
    flat = launch._flat_arguments(registry.signature(config))
    return [int(np.uint32(words[i] & 0xFFFFFFFF).view(np.int32)) for i, kind in enumerate(_words(flat))
            if kind == "int32"]


def _words(flat):
    for kind in flat:
        if isinstance(kind, int):
            yield from ["array"] * (5 + 2 * kind)
        else:
            yield kind


def ptr(x):
    return x.data.ptr


def test_remembered_calls_launch_their_own_arrays(monkeypatch):
    """Four decode steps with new q, k, v, out and cache_seqlens objects each (and the caches as new
    views at other addresses): one plan, and every launch carries that call's pointers and stream.
    The append as a launch of its own (what windows and cache_leftpad take)."""
    monkeypatch.setattr(kvcache, "FUSED_APPEND", False)
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("append")
        for step in range(4):
            q = FakeArray(q.shape, q.dtype)
            k_cache, v_cache = k_cache.view_at(4096 * step), v_cache.view_at(4096 * step)
            new = {name: FakeArray(kwargs[name].shape, kwargs[name].dtype) for name in ("k", "v", "out",
                                                                                       "cache_seqlens")}
            result = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **new)
            assert result is new["out"]
            plan, = kvcache._REMEMBERED.values()
            append, decode = driver.seen[-2:]
            assert pointers(append, plan.append_config)[:5] == [ptr(k_cache), ptr(v_cache), ptr(new["k"]),
                                                                ptr(new["v"]), ptr(new["cache_seqlens"])]
            got = pointers(decode, plan.decode_kernel.config)
            assert got[:4] == [ptr(q), ptr(k_cache), ptr(v_cache), ptr(new["out"])]
            assert got[8] == ptr(new["cache_seqlens"])
            assert scalars(decode, plan.decode_kernel.config)[1] == -1  # fixed_len: lengths on the device
            assert append[1] == decode[1] == 0  # the current stream
        assert len(driver.seen) == 8 and len(kvcache._REMEMBERED) == 1


def test_remembered_int_lengths_reach_the_kernels_and_overflow_raises(monkeypatch):
    monkeypatch.setattr(kvcache, "FUSED_APPEND", False)  # the append kernel's length too
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("append", capacity=64)
        del kwargs["cache_seqlens"]
        for length in (10, 11, 63):
            nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, **kwargs)
            plan, = kvcache._REMEMBERED.values()
            append, decode = driver.seen[-2:]
            assert scalars(append, plan.append_config)[0] == length
            assert scalars(decode, plan.decode_kernel.config)[1] == length
        launches = len(driver.seen)
        for length in (64, -1):
            with pytest.raises(ValueError, match="overflows|must be in"):
                nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, **kwargs)
        assert len(driver.seen) == launches  # nothing launched, nothing written


def test_lse_is_each_calls_own_array():
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("plain")
        first = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)[1]
        second = nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)[1]
        plan, = kvcache._REMEMBERED.values()
        assert first is not second and first.shape == (1, 32, 1) and first.dtype == np.float32
        assert pointers(driver.seen[-1], plan.decode_kernel.config)[4] == ptr(second)


def test_each_stream_has_its_own_workspace_and_a_grown_one_is_used():
    """Split partials live in the current stream's workspace: another stream's call uses another
    one; a bigger call that replaces a stream's workspace makes the first plan re-make its views."""
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("plain")

        def o_part_of_last_call():
            plan, = [p for p in kvcache._REMEMBERED.values() if p.template.batch == 1]
            assert plan.splits > 1
            return pointers(driver.seen[-1], plan.decode_kernel.config)[5]

        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        on_default = o_part_of_last_call()
        cupy.cuda.stream = FakeStream(0x1234)
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        assert driver.seen[-1][1] == 0x1234 and o_part_of_last_call() != on_default
        cupy.cuda.stream = FakeStream(0)
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        assert driver.seen[-1][1] == 0 and o_part_of_last_call() == on_default

        first = kvcache._workspaces[(0, 0)]
        (big_q, big_k, big_v), big = decode_case("plain", batch=4, capacity=1 << 16)
        nbflash.flash_attn_with_kvcache(big_q, big_k, big_v, num_splits=64, **big)  # 4 MiB of partials
        workspace = kvcache._workspaces[(0, 0)]
        assert workspace is not first
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        assert workspace.ptr <= o_part_of_last_call() < workspace.ptr + workspace.mem.size


def test_key_holds_what_the_plan_depends_on():
    """Calls that differ in anything validation or planning reads have different keys; calls that
    differ only in where the (16-byte aligned) arrays are share one."""
    with fake_gpu() as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("append")
        flags = (None, False, (-1, -1), 0.0, True, 0, False)

        def key(q=q, k_cache=k_cache, cache_seqlens=kwargs["cache_seqlens"], out=kwargs["out"], flags=flags):
            arrays = (q, k_cache, v_cache, kwargs["k"], kwargs["v"], None, None, None, None, None, None, out)
            return kvcache._remember_key(arrays, cache_seqlens, flags)

        base = key()
        assert key(q=q.view_at(4096), k_cache=k_cache.view_at(1 << 20)) == base
        assert key(cache_seqlens=FakeArray((1,), np.int32)) == base
        other_device = FakeArray(q.shape, q.dtype, FakeMemory(q.data.ptr, 1 << 20, device_id=1))
        differ = [
            key(q=q.view_at(2)),  # rows no longer 16-byte aligned: the gathered route
            key(k_cache=FakeArray(k_cache.shape, k_cache.dtype, strides=(k_cache.strides[0] * 2,
                                                                          *k_cache.strides[1:]))),
            key(q=FakeArray(q.shape, np.float32)),
            key(q=other_device),
            key(out=None), key(out=FakeArray((1, 1, 32, 128), np.float16, strides=(16384, 16384, 512, 2))),
            key(cache_seqlens=None), key(cache_seqlens=5), key(cache_seqlens=FakeArray((2,), np.int32)),
            key(flags=(None, True, (-1, -1), 0.0, True, 0, False)),
            key(flags=(None, False, (-1, -1), 0.0, True, 2, False)),
            key(flags=(0.5, False, (-1, -1), 0.0, True, 0, False)),
        ]
        assert base not in differ and len(set(differ)) == len(differ)
        # Not plain arrays or plain Python values: no key, the full check.
        assert key(q=np.zeros(q.shape, np.float16)) is None
        assert key(flags=(None, np.bool_(False), (-1, -1), 0.0, True, 0, False)) is None
        assert key(flags=(None, False, [-1, -1], 0.0, True, 0, False)) is None
        assert key(flags=(None, False, (-1, -1), 0, True, 0, False)) is None


def test_bad_inputs_after_a_remembered_call_still_raise():
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("append")
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        launches = len(driver.seen)
        out = kwargs["out"]
        bad = [
            (dict(out=FakeArray(out.shape, np.float32)), TypeError, "out.dtype"),
            (dict(cache_seqlens=FakeArray((2,), np.int32)), ValueError, "cache_seqlens must have shape"),
            (dict(cache_seqlens=FakeArray((1,), np.int64)), TypeError, "cache_seqlens.dtype"),
            (dict(k=FakeArray((1, 1, 8, 128), np.float16, FakeMemory(0x1000, 4096, device_id=1))), ValueError,
             "on GPU 1"),
            (dict(causal="yes"), TypeError, "causal must be a bool"),
            (dict(softmax_scale=float("nan")), ValueError, "finite"),
            (dict(num_splits=-1), ValueError, "num_splits"),
        ]
        for change, error, message in bad:
            with pytest.raises(error, match=message):
                nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, **change})
        out._shape = [1, 32, 1, 128]  # reshaped in place (CuPy's shape setter): no longer q's shape
        with pytest.raises(ValueError, match="out must have shape"):
            nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
        assert len(driver.seen) == launches


def test_two_plans_sharing_a_kernel_launch_their_own_scratch():
    """Two cache sizes, one decode kernel (one parameter buffer), called in turn: each launch
    carries its own plan's split scratch and counters, never the other's left in the buffer."""
    with fake_gpu(record=True) as (cupy, driver):
        cases = [decode_case("plain", capacity=capacity) for capacity in (1024, 4096)]
        for _ in range(3):
            for (q, k_cache, v_cache), kwargs in cases:
                nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
                plan, = [p for p in kvcache._REMEMBERED.values() if p.template.capacity == k_cache.shape[1]]
                (lse, o_part, lse_part, counters), _ = plan.scratch(0)
                assert pointers(driver.seen[-1], plan.decode_kernel.config)[3:8] == [
                    ptr(kwargs["out"]), ptr(lse), ptr(o_part), ptr(lse_part), ptr(counters)]
        plans = list(kvcache._REMEMBERED.values())
        assert len(plans) == 2 and plans[0].decode_kernel is plans[1].decode_kernel
        assert plans[0].splits != plans[1].splits


def test_importing_the_fake_leaves_the_simulator_switch_alone():
    """Imported (as above), host_profile_fake must not switch Numba to its simulator: on a GPU machine
    that turned every later compile in the same test process into the simulator's."""
    import subprocess

    scripts = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import host_profile_fake; "
            "print(os.environ.get('NUMBA_ENABLE_CUDASIM'))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", code, scripts], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "None"


def test_fused_append_is_one_launch_with_the_calls_k_and_v(monkeypatch):
    """With the append inside the decode launch, a decode step with new tokens is one launch, and it
    carries that call's k and v (after the rotary tables); a left window keeps the append kernel."""
    monkeypatch.setattr(kvcache, "FUSED_APPEND", True)
    with fake_gpu(record=True) as (cupy, driver):
        (q, k_cache, v_cache), kwargs = decode_case("append")
        for step in range(3):
            new = {name: FakeArray(kwargs[name].shape, kwargs[name].dtype) for name in ("k", "v", "out")}
            nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, **{**kwargs, **new})
            plan, = kvcache._REMEMBERED.values()
            assert plan.fused_append and plan.decode_kernel.config.append
            got = pointers(driver.seen[-1], plan.decode_kernel.config)
            assert got[:4] == [ptr(q), ptr(k_cache), ptr(v_cache), ptr(new["out"])]
            assert got[14:16] == [ptr(new["k"]), ptr(new["v"])]
        assert len(driver.seen) == 3
        nbflash.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, window_size=(8, 0), **kwargs)
        assert len(driver.seen) == 5 and not kvcache._last_plan.fused_append
