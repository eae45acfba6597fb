"""Lesson 08: a guided reading of nbflash's Hopper forward kernel (wgmma, TMA, warp specialization).

Lesson 06's kernel, ``nbflash/kernels/forward_mma.py``, has every warp do everything: copy its
tiles (cp.async), wait for them, multiply (mma.sync, which makes the warp wait for its result), run
the softmax. Hopper (sm_90a) adds instructions that run without the threads that started them:

  TMA      one thread hands the copy engine a tensor map and a box corner; the whole tile lands in
           shared memory, already in the layout the tensor cores read, and reports on an mbarrier;
  mbarrier a barrier word in shared memory that counts arrivals and bytes, completes in phases, and
           that threads poll by the phase's parity;
  wgmma    a 128-thread warpgroup multiplies a 64-row tile with operands read straight from shared
           memory (through a 64-bit descriptor) or, for A, from registers; it runs asynchronously
           until the group's wait_group.

nbflash's ``nbflash/kernels/forward_sm90.py`` builds FlashAttention-3's structure from them: one
producer warpgroup that only issues copies, two consumer warpgroups that only multiply and run the
online softmax, a ring of K/V stages between them, and registers moved from the producer to the
consumers (setmaxnreg). The algorithm is still lesson 05's: a block per Q tile, one pass over the
K/V tiles with m_i, l_i and acc, causal tiles skipped.

Like lesson 06 this lesson copies no kernel code. It prints, topic by topic, what each mechanism
does, the numbers it takes for this problem (byte counts, parities, register caps, which thread
holds which element), and where it is in the library, as file:line references found by searching
the files, so they stay right while the files change. It checks the layouts it states with a tiny
probe kernel of its own (a TMA load and one wgmma), and runs the library's kernel through
``nbflash.kernel_family("sm90")`` against float64. On a GPU of compute capability 9.0 it runs a
realistic problem (flash-attn's benchmark grid: nheads = 2048 / headdim, batch = 16384 / seqlen)
and times the sm90 family next to the mma family. The simulator emulates every Hopper primitive
(nbflash/primitives_sm90.py), so the same script runs on the CPU at a tiny size.

Run: python kernels/08_reading_nbflash_sm90.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import ast
import dataclasses
import importlib
import inspect
import os
import sys
import textwrap
import time

import _common
import numpy as np
from numba import cuda, float32, uint16, uint32, uint64

from nbflash import primitives_sm90 as H
from nbflash.primitives import shared_address, static_range, unroll

REPO = os.path.dirname(_common.KERNELS_DIR)

# ---------------------------------------------------------------------------------------------------
# The reading guide: topics, each an explanation and the places in the library that show it.
# An anchor is (file, scope, code, nth, what): the nth line of ``file`` inside function or class
# ``scope`` (None: the whole file) that contains ``code``.
# ---------------------------------------------------------------------------------------------------

KERNEL = "nbflash/kernels/forward_sm90.py"
PRIMS = "nbflash/primitives_sm90.py"
REGISTRY = "nbflash/kernels/registry.py"
CONFIGS = "nbflash/configs.py"
NOTES = "docs/perf-notes.md"

TOPICS = [
    (
        "1. Roles: one producer warpgroup, two consumers, and registers moved between them",
        """
        A block has 128 * (consumers + 1) threads, cut into warpgroups of 128 (4 warps). Warpgroup 0
        is the producer: of its 128 threads one, elected in warp 0, issues every TMA copy, and the
        other 127 have nothing to do. Warpgroup 1 + c is consumer c and owns query rows [64 c,
        64 c + 64) of the block's tile: a wgmma is always 64 rows tall, so a 128-row block needs two
        consumers. The register file of an SM is 64K 32-bit registers; with 384 threads in one
        block, ptxas can give each thread at most 65536 / 384 = 170, rounded down to 168. The
        consumers need more (the S and O accumulators alone are block_n / 2 + headdim_padded / 2
        float32 registers per thread), the producer needs almost none. setmaxnreg moves them: the producer
        lowers its cap (setmaxnreg.dec), the consumers raise theirs (setmaxnreg.inc), and the
        totals must fit in the file. It needs a register cap at entry, which the launch bounds
        (threads, 1 block per SM) give ptxas. The warpgroup's index is tid // 128 passed through a
        shuffle from lane 0 (warpgroup_index): ptxas then knows every lane of a warp holds the same
        value, and keeps what the consumer makes from it (its wgmma descriptors) in the uniform
        registers wgmma reads them from.
        """,
        [
            (KERNEL, "forward_sm90", "group = warpgroup_index(tid)", 0,
             "which warpgroup this thread is in (tid // 128 through lane 0: warp-uniform to ptxas)"),
            (KERNEL, "forward_sm90", "if group == 0:", 0, "the producer's branch"),
            (KERNEL, "forward_sm90", "setmaxnreg_dec(PRODUCER_REGS)", 0, "the producer gives registers back"),
            (KERNEL, "forward_sm90", "if elect_sync() == uint32(1):", 0, "one lane of warp 0 issues all copies"),
            (KERNEL, "forward_sm90", "setmaxnreg_inc(CONSUMER_REGS)", 0, "the consumers take them"),
            (KERNEL, "forward_sm90", "row0 = m_start + 64 * consumer", 0, "the consumer's first row (plus 8: its second)"),
            (KERNEL, "Sm90ForwardConfig", "producer_registers: int", 0, "the two caps, per config"),
            (KERNEL, "build_forward_sm90", "@launch_bounded(THREADS, 1)", 0, "the register cap at entry"),
            (PRIMS, "setmaxnreg_inc", "_check_maxnreg(count)", 0, "simulator: checks the count only"),
            (PRIMS, None, "setmaxnreg_inc = _ptx_literal(", 0, "GPU: the PTX instruction"),
        ],
    ),
    (
        "2. The mbarrier ring: full and empty barriers, phases and parity, expect_tx bytes",
        """
        The K and V tiles pass through a ring of `stages` slots in shared memory. Each slot has
        three mbarriers: k_full and v_full (count 1: the producer's arrive) and kv_empty (count
        256: every consumer thread arrives when it is done with the slot). An mbarrier completes a
        phase when all its arrivals are in AND its transaction count is back to zero. The producer
        calls arrive.expect_tx(bytes) before issuing the copies: that is its one arrival and it
        raises the count by the tile's bytes; each TMA box lowers it by its own bytes as it lands.
        So the phase completes exactly when the last byte of the tile is in shared memory, and the
        byte count must match the boxes to the byte (a wrong count hangs the kernel; debug builds
        bound the wait and trap). Nobody reads the barrier's counter: a waiter asks whether the
        phase of a given parity (0 or 1) has completed. Tile i uses slot i % stages for the
        (i // stages)-th time, so the consumers wait on k_full with parity use & 1, and the
        producer, before refilling a slot, waits on kv_empty with the parity of the previous use.
        One bit is enough because no barrier can get two phases ahead of its waiters: a slot is not
        refilled before the consumers released it.
        """,
        [
            (KERNEL, "forward_sm90", "kv_empty = v_full + uint32(8 * STAGES)", 0, "the barriers' words, after the tiles"),
            (KERNEL, "forward_sm90", "mbarrier_init(k_full + uint32(8 * slot), 1)", 0, "full: one arrival (the producer's)"),
            (KERNEL, "forward_sm90", "mbarrier_init(kv_empty + uint32(8 * slot), EMPTY_ARRIVALS)", 0,
             "empty: every consumer thread"),
            (KERNEL, "forward_sm90", "fence_mbarrier_init()", 0, "the inits are visible to the copy engine"),
            (KERNEL, "forward_sm90", "cuda.syncthreads()", 0, "... and to every thread, before any waits"),
            (KERNEL, "forward_sm90", "mbarrier_arrive_expect_tx(q_full, Q_BYTES)", 0, "Q: once, all its bytes"),
            (KERNEL, "forward_sm90", "slot, use = i % STAGES, i // STAGES", 0, "tile i -> slot and use"),
            (KERNEL, "forward_sm90", "mbarrier_wait(kv_empty + uint32(8 * slot), (use - 1) & 1)", 0,
             "producer: the slot's previous tile was released"),
            (KERNEL, "forward_sm90", "mbarrier_arrive_expect_tx(k_full + uint32(8 * slot), KV_BYTES)", 0,
             "producer: arrive, expecting the K tile's bytes"),
            (KERNEL, "forward_sm90", "mbarrier_wait(k_full + uint32(8 * slot), use & 1)", 0, "consumer: K_j has landed"),
            (KERNEL, "forward_sm90", "mbarrier_wait(v_full + uint32(8 * slot), use & 1)", 0,
             "consumer: V_j, waited for only before P V"),
            (KERNEL, "forward_sm90", "mbarrier_arrive(kv_empty + uint32(8 * slot))", 0, "consumer: done with the slot"),
            (PRIMS, "mbarrier_try_wait_parity", "return barrier.phase % 2 != int(parity) % 2", 0,
             "the parity rule, in the emulation"),
            (PRIMS, "make_mbarrier_wait", "trap()", 0, "the bounded wait of debug builds"),
        ],
    ),
    (
        "3. TMA: tensor maps, boxes, and the 128-byte swizzle",
        """
        A tensor map is a 128-byte descriptor of a global array (address, shape, strides, element
        type) and of the box one copy moves. The host builds it (cuTensorMapEncodeTiled) per call,
        for q, k and v, as 4-D maps of (batch, seqlen, heads, headdim) with boxes of 1 x rows x 1 x
        64 columns; a kernel argument carries the three maps in global memory, and the issuing
        thread runs a proxy fence once per map so the copy engine sees what the host wrote. One TMA
        instruction then copies a box, given its corner (column, head, row, batch, innermost
        first); rows past the sequence and columns past headdim arrive as zeros, and they still
        count toward the expected bytes. So no thread computes an address, checks a bound or
        pads a tile. A box row is 64 16-bit elements = 128 bytes, which is why a tile is stored as
        64-column chunks. With the 128B swizzle, the copy stores the 16-byte piece j of row r at
        piece j XOR (r % 8) of that row. Without it, the same piece of 8 consecutive rows would sit
        at the same banks (a row is exactly the 32 banks' width), and reading a column slice would
        hit the same 4 banks 8 times; with it the 8 rows' pieces fill all 32 banks. This is the
        layout wgmma's descriptor calls "128B swizzle", so the tile is read in place. The XOR
        uses address bits 4-6 and 7-9, so a tile must start on a 1024-byte boundary.
        """,
        [
            (REGISTRY, None, "HOST_ARGUMENTS = {", 0, "the launcher adds the maps to every launch"),
            (KERNEL, "_words", "tensor_map_4d_words(x, (1, rows, 1, CHUNK), SWIZZLE_128B)", 0,
             "the three maps and their boxes"),
            (PRIMS, "cached_tensor_maps", "maps = _MAPS.pop(full_key, None)", 0, "maps kept for buffers used again"),
            (PRIMS, "_tensor_map_4d_words", "cuTensorMapEncodeTiled(", 0, "GPU: the driver encodes the map"),
            (KERNEL, "forward_sm90", "fence_proxy_tensormap_acquire(q_map)", 0, "the maps came from the host"),
            (KERNEL, "forward_sm90", "base = tile_base(shared_address(smem))", 0, "tiles start on a 1024-byte boundary"),
            (PRIMS, "tile_base", "return window_address + ((uint32(1024)", 0, "the next boundary (the launch adds 1 KB of slack)"),
            (KERNEL, "forward_sm90", "tma_load_4d(q_tile + uint32(chunk * Q_CHUNK_BYTES)", 0,
             "one box per 64-column chunk of Q"),
            (KERNEL, "forward_sm90", "tma_load_4d(k_tile + uint32(chunk * KV_CHUNK_BYTES)", 0,
             "K_j's boxes into its slot"),
            (PRIMS, "_chunk_order", "(j ^ (r % 8) if swizzle", 0, "the swizzle, in the emulation"),
        ],
    ),
    (
        "4. Shared-memory matrix descriptors: how wgmma finds its operands",
        """
        A wgmma operand in shared memory is named by a 64-bit descriptor: the start address >> 4
        (bits 0-13), two byte strides >> 4, LBO (bits 16-29) and SBO (bits 32-45), and the swizzle
        mode (bits 62-63). For a K-major operand (k contiguous: Q, and K for S = Q K^T) in the
        128B swizzle, a row of the operand is a 128-byte swizzled row and SBO is the distance
        between groups of 8 rows, 1024 bytes; LBO is not used. A k16 step is 16 elements = 32 bytes
        further along the row, and after 4 steps the next 64-column chunk; since the swizzle is
        computed from the address bits, stepping is adding to the start field, never re-encoding.
        V is the same keys x headdim image, but for O += P V its rows (keys) are the k dimension and
        headdim is n: the n index is contiguous, so V is an MN-major operand (wgmma's transpose bit
        set). There SBO is the distance between groups of 8 keys (1024 bytes), LBO between 64-column
        chunks (a whole chunk of the tile), and a k16 step is 16 keys = 16 rows = 2048 bytes.
        The same TMA image serves both products; only the descriptor differs.
        """,
        [
            (PRIMS, "descriptor_bits", "return (((uint64(window_address)", 0, "the bit fields"),
            (PRIMS, None, "#   K-major,  128B:", 0, "the layouts the emulation decodes"),
            (KERNEL, "build_forward_sm90", "K_MAJOR = (16, 1024)", 0, "Q and K: (LBO, SBO)"),
            (KERNEL, "build_forward_sm90", "V_MN_MAJOR = (KV_CHUNK_BYTES, 1024)", 0, "V: (LBO, SBO)"),
            (PRIMS, "k_step", "return uint64(((kk // 4) * chunk_bytes + (kk % 4) * 32) >> 4)", 0,
             "k16 step kk of a K-major tile"),
            (KERNEL, "forward_sm90", "desc_q = smem_descriptor(q_tile + uint32(64 * consumer * ROW_BYTES)", 0,
             "consumer c's 64 rows of Q"),
            (KERNEL, "issue_pv", "desc_v + uint64(ks * 16 * ROW_BYTES >> 4)", 0, "k16 step ks of V: 16 keys"),
            (PRIMS, "smem_descriptor", "_window().to_window(int(address))", 0,
             "simulator: an emulated shared window holds the 14-bit addresses"),
        ],
    ),
    (
        "5. wgmma SS and RS, and the accumulator fragment: who holds which element",
        """
        wgmma.m64nNk16 computes D (64 x N, float32) += A (64 x 16) B (16 x N) for a whole warpgroup.
        SS: A and B both come from shared memory by descriptor; S = Q K^T is SS, headdim / 16 steps
        into the same accumulator (the first with scale_d = 0, which ignores the old values). RS: A
        comes from registers, 4 uint32 per thread, each two 16-bit values; O += P V is RS, so P,
        computed in registers by the softmax, never goes to shared memory. D is spread over the
        128 threads as N / 2 float32 registers each, in a fixed pattern (below): warp w holds rows
        [16 w, 16 w + 16); lane l (g = l // 4, q4 = l % 4) holds rows 16 w + g and 16 w + g + 8,
        and in each 8-column group the two columns 2 q4, 2 q4 + 1. So a row lives in the 4 lanes of
        one quad, each holding N / 4 of its columns: the row max and row sum are a thread's own
        reduction followed by two shuffles inside the quad, as in lesson 06's mma.sync layout. And
        the RS A fragment of a k16 slice has exactly the accumulator's layout at N = 16: the 8
        registers of S's slice s, packed in pairs to 16 bits, ARE P's A registers of k-step s. No
        data moves between threads. The lesson checks all of this for every thread below.
        """,
        [
            (KERNEL, "build_forward_sm90", "wgmma_qk = make_wgmma_ss(BN, AB, 0)", 0, "S = Q K^T: SS, K K-major"),
            (KERNEL, "build_forward_sm90", "wgmma_pv = make_wgmma_rs(HDP, AB, 1)", 0, "O += P V: RS, V MN-major"),
            (KERNEL, "issue_qk", "uint32(0 if kk == 0 else 1)", 0, "scale_d: the first step overwrites"),
            (KERNEL, "issue_pv", "acc_o = wgmma_pv(acc_o, p_regs[4 * ks]", 0, "P's registers 4 ks .. 4 ks + 3"),
            (KERNEL, "pack_p", "p[i] = pack(s[2 * i], s[2 * i + 1])", 0, "S -> P's A registers, in place"),
            (KERNEL, "row_max", "return quad_max(m)", 0, "the row max: a quad shuffle"),
            (KERNEL, "write_output", "l_row = quad_sum(l_i[rh])", 0, "the row sum, reduced once at the end"),
            (KERNEL, "mask_scores", "hidden(n_start + 8 * c + 2 * q4 + e", 0, "a register's column, for the mask"),
            (KERNEL, "write_output", "col = 8 * c + 2 * q4", 0, "... and the output's pair, one 32-bit store"),
            (PRIMS, "make_wgmma_ss", "Register r of thread t", 0, "the layout, documented"),
            (PRIMS, "_acc_coords", "cols = 8 * (r[None, :] // 4)", 0, "the layout, emulated"),
        ],
    ),
    (
        "6. Fences, commit and wait_group: ordering asynchronous products",
        """
        A wgmma is issued, not finished, when the next instruction runs. Four things keep it right.
        wgmma.fence goes before a batch of wgmmas whose accumulator or A registers ordinary code
        has just written (the zeroed S, the rescaled O, the packed P): it orders those writes
        before the tensor cores read the registers. commit_group closes the wgmmas issued since the
        last commit into a group. wait_group N waits until at most N groups are still running;
        only then may the thread read (or overwrite) the accumulator, or release the shared tiles
        the group reads. fence_operands is not an instruction: an empty asm statement through which
        the register values pass, so the compiler can neither move their producers below it nor
        their readers above it. The plain loop uses wait_group 0 after each product. TMA-written
        tiles need no proxy fence before wgmma reads them (their mbarrier orders them); tiles
        written by ordinary stores would need fence.proxy.async before the barrier. In the
        simulator every asynchronous operation completes at once, so a missing wait is invisible
        there: only the GPU catches it.
        """,
        [
            (KERNEL, "forward_sm90", "acc_s = fence_operands(registers_from(s, S_REGS))", 0,
             "S's registers pinned as a tuple"),
            (KERNEL, "forward_sm90", "wgmma_fence()", 0, "before the product reads them"),
            (KERNEL, "issue_qk", "wgmma_commit()", 0, "S's k-steps: one group"),
            (KERNEL, "forward_sm90", "wgmma_wait(0)", 0, "S has landed: the softmax may read it"),
            (KERNEL, "forward_sm90", "registers_to(s, fence_operands(acc_s))", 0, "back into the register array"),
            (PRIMS, "wgmma_fence", "Nothing may write those registers between it and the wgmma", 0,
             "what breaks it (ptxas C7519)"),
            (PRIMS, "fence_proxy_async", "order this thread's generic-proxy shared-memory writes", 0,
             "for tiles written by ordinary stores"),
            (PRIMS, None, "Asynchronous operations (the bulk copy, TMA, wgmma) complete at once", 0,
             "why the simulator cannot catch a missing wait"),
        ],
    ),
    (
        "7. The overlapped loop and ping-pong, and what they measured",
        """
        In the plain loop each consumer waits for S, runs the softmax, then waits for P V: while its
        softmax runs, its tensor-core work is done and only the other consumer can use the tensor
        cores. FlashAttention-3 adds two schedules, both in the kernel behind config flags. The
        overlapped loop issues S_(j+1) = Q K_(j+1)^T and O += P_j V_j as two groups, waits with
        wait_group 1 (S_(j+1), the older group, has landed; P_j V_j may still run), runs the
        softmax of S_(j+1) under P_j V_j, then waits with wait_group 0 and rescales O. Ping-pong
        adds two named barriers (ids 1 and 2, 256 threads each: one consumer waiting, the other
        handing over): a consumer waits for its turn before issuing its products and hands the
        turn over right after, so one consumer's products run during the other's softmax.
        Measured on the H200 (docs/perf-notes.md), both were 9-21 % slower than the plain loop at
        headdim 128 and 2-3 % faster at headdim 64. The overlapped loop keeps S, O and the packed P
        live at once, more registers than the 232 the consumers get at headdim 128 once the mask
        code is in (some configs spilled), and ptxas had moved the softmax's exp2s below the second
        wait anyway. So the planner runs the plain loop, where the two consumers still overlap each
        other, unordered: while one runs its softmax, the other's products can use the tensor
        cores. One more difference the code shows: in the overlapped loop a consumer holds two slots
        at once (K_(j+1) and V_j), so with 2 stages the producer cannot start tile j+2 before slot j
        is released at the end of the iteration, and that load is no longer hidden; the measured
        headdim-128 configs had 2 stages, the headdim-64 ones 3 (an exercise in docs/workshop.md
        separates the two effects).
        """,
        [
            (KERNEL, "Sm90ForwardConfig", "overlap: bool = False", 0, "the flags"),
            (KERNEL, "forward_sm90", "elif n_tiles > 0:", 0, "the overlapped loop"),
            (KERNEL, "forward_sm90", "acc_s = issue_qk(acc_s, desc_q, k_descriptor(k_ring, slot))", 1,
             "S_(j+1) issued ..."),
            (KERNEL, "forward_sm90", "acc_o = issue_pv(acc_o, p_regs, v_descriptor(v_ring, prev_slot))", 0,
             "... with P_j V_j"),
            (KERNEL, "forward_sm90", "wgmma_wait(1)", 0, "S_(j+1) landed, P_j V_j may run on"),
            (KERNEL, "forward_sm90", "named_barrier_arrive(1, TURN_THREADS)", 0, "consumer 0 takes the first turn"),
            (KERNEL, "forward_sm90", "named_barrier_sync(1 + consumer, TURN_THREADS)", 0, "wait for this turn"),
            (KERNEL, "forward_sm90", "named_barrier_arrive(2 - consumer, TURN_THREADS)", 0, "hand it over"),
            (KERNEL, "forward_sm90", "named_barrier_sync(1, TURN_THREADS)", 0, "absorb the last hand-over"),
            (CONFIGS, None, "SM90_FORWARD = [", 0, "the planned configs: the plain loop"),
            (NOTES, None, "### Schedules: the overlapped loop, ping-pong", 0, "the measurements"),
        ],
    ),
]


def where(path, line):
    """A file:line reference relative to the repository."""
    return f"{os.path.relpath(path, REPO)}:{line}"


def _source_path(relative):
    """The file behind a repository path: the imported module's file for nbflash (so that an
    installed copy is read when the lessons were copied elsewhere), else the checkout's file."""
    if relative.startswith("nbflash/") and relative.endswith(".py"):
        module = importlib.import_module(relative[:-3].replace("/", "."))
        return inspect.getsourcefile(module)
    return os.path.join(REPO, relative)


_SOURCES = {}


def _lines_and_scopes(path):
    """(lines, {name: [(first line, last line), ...]}) of a file; scopes only for Python files."""
    if path not in _SOURCES:
        text = open(path).read() if os.path.exists(path) else ""
        scopes = {}
        if path.endswith(".py") and text:
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    scopes.setdefault(node.name, []).append((node.lineno, node.end_lineno))
        _SOURCES[path] = (text.splitlines(), scopes)
    return _SOURCES[path]


def find_anchor(relative, scope, code, nth):
    """(path, line number, line) of the nth line containing ``code`` (inside ``scope``), or None."""
    path = _source_path(relative)
    lines, scopes = _lines_and_scopes(path)
    ranges = scopes.get(scope, []) if scope else [(1, len(lines))]
    hits = [n for lo, hi in ranges for n in range(lo, hi + 1) if code in lines[n - 1]]
    if len(hits) <= nth:
        return None
    number = hits[nth]
    return path, number, lines[number - 1].strip()


def say(text, indent="  "):
    """A paragraph of the guide, wrapped."""
    print(textwrap.fill(" ".join(textwrap.dedent(text).split()), 100, initial_indent=indent,
                        subsequent_indent=indent))


def print_anchors(anchors):
    """Where the topic is in the library; returns the anchors not found."""
    missing = []
    print("  where:")
    for relative, scope, code, nth, what in anchors:
        found = find_anchor(relative, scope, code, nth)
        if found is None:
            missing.append(f"{relative} ({scope or 'file'}): {code!r}")
            print(f"    NOT FOUND in {relative}: {code!r} ({what}); the file changed: update this lesson")
            continue
        path, number, line = found
        shown = line if len(line) <= 64 else line[:61] + "..."
        print(f"    {where(path, number):42s} {what}")
        print(f"    {'':42s}   {shown}")
    return missing


# ---------------------------------------------------------------------------------------------------
# Facts computed for this problem's config, printed under each topic.
# ---------------------------------------------------------------------------------------------------

GROUP = 128  # threads of a warpgroup
REGISTER_FILE = 65536  # 32-bit registers of an SM


def registers_facts(config):
    entry = min(255, REGISTER_FILE // config.threads // 8 * 8)
    print(f"  this config: {config.threads} threads = 1 producer + {config.consumers} consumer warpgroup(s);"
          f" entry cap {entry} registers per thread")
    if config.consumers == 2:
        total = GROUP * config.producer_registers + 2 * GROUP * config.consumer_registers
        print(f"  setmaxnreg: producer {config.producer_registers}, consumers {config.consumer_registers}:"
              f" 128 x {config.producer_registers} + 256 x {config.consumer_registers} = {total}"
              f" of the {REGISTER_FILE} registers")
    else:
        print("  one consumer: the entry cap is already high enough, so the kernel skips setmaxnreg")
    acc = config.block_n // 2 + config.headdim_padded // 2
    print(f"  a consumer thread's accumulators: S {config.block_n // 2} + O {config.headdim_padded // 2}"
          f" = {acc} float32 registers, plus P {config.block_n // 4} uint32")


def ring_schedule(n_tiles, stages):
    """For each key tile: (tile, slot, use, parity the producer waits on kv_empty (None: no wait),
    parity the consumers wait on k_full and v_full)."""
    rows = []
    for i in range(n_tiles):
        slot, use = i % stages, i // stages
        rows.append((i, slot, use, None if use == 0 else (use - 1) & 1, use & 1))
    return rows


def ring_facts(config, n_tiles, this_problem):
    chunks = config.headdim_padded // 64
    print(f"  this config: {config.stages} stages of K and V, block_n = {config.block_n} keys,"
          f" headdim {config.headdim} padded to {config.headdim_padded} ({chunks} chunk(s) of 64)")
    print(f"  expect_tx: Q {config.q_bytes} bytes (block_m {config.block_m} x {config.headdim_padded} x 2,"
          f" {chunks} box(es) of {config.block_m} x 64); K and V {config.kv_bytes} bytes each"
          f" ({chunks} box(es) of {config.block_n} x 64)")
    print(f"  kv_empty counts {config.consumers * GROUP} arrivals per phase (every consumer thread)")
    print(f"  the ring for {n_tiles} key tiles (this problem's blocks visit at most {this_problem}; tile i:"
          f" slot i % {config.stages}, use i // {config.stages}):")
    print("    tile  slot  use  producer waits kv_empty[slot]   consumers wait k_full/v_full[slot]")
    for i, slot, use, empty, full in ring_schedule(n_tiles, config.stages):
        producer = "no wait (first use)" if empty is None else f"parity {empty} (use {use - 1} released)"
        print(f"    {i:4d}  {slot:4d}  {use:3d}  {producer:31s} parity {full}")


def swizzled_offset(row, col):
    """Element offset of (row, col) in a 1024-byte-aligned tile of 64-column rows, 128B swizzle."""
    return row * 64 + 8 * ((col // 8) ^ (row % 8)) + col % 8


def swizzle_facts():
    print("  piece (16 bytes = 8 elements) stored at each position of rows 0-7 (rows 8-15 repeat):")
    print("    row   position 0 1 2 3 4 5 6 7")
    for r in range(8):
        held = [next(j for j in range(8) if swizzled_offset(r, 8 * j) == r * 64 + 8 * p) for p in range(8)]
        print(f"    {r:3d}            {' '.join(str(j) for j in held)}")


def descriptor_facts(config):
    q_chunk, kv_chunk = config.block_m * 128, config.block_n * 128
    q_steps = [(kk // 4) * q_chunk + (kk % 4) * 32 for kk in range(config.headdim_padded // 16)]
    v_steps = [ks * 16 * 128 for ks in range(config.block_n // 16)]
    print(f"  Q and K: K-major, LBO 16 (unused), SBO 1024; S = Q K^T takes {len(q_steps)} k16 steps, at byte"
          f" offsets (Q) {q_steps}")
    print(f"  V: MN-major, LBO {kv_chunk} (a 64-column chunk of the tile), SBO 1024; O += P V takes"
          f" {len(v_steps)} k16 steps at {v_steps[:4]}{' ...' if len(v_steps) > 4 else ''}")


def accumulator_coords(n):
    """(rows, cols), each (128, n // 2): the element of D that register r of thread t holds."""
    t = np.arange(GROUP)[:, None]
    r = np.arange(n // 2)[None, :]
    lane = t % 32
    rows = 16 * (t // 32) + lane // 4 + 8 * ((r // 2) % 2)
    cols = 8 * (r // 4) + 2 * (lane % 4) + r % 2
    return tuple(np.broadcast_arrays(rows, cols))


def rs_a_coords():
    """(rows, cols), each (128, 8): the element of a 64 x 16 A tile in the 8 16-bit halves of the
    RS A registers a0..a3 (half 2 j + h is register a_j's low (h = 0) or high half)."""
    t = np.arange(GROUP)[:, None]
    half = np.arange(8)[None, :]
    j, h = half // 2, half % 2
    lane = t % 32
    rows = 16 * (t // 32) + lane // 4 + 8 * (j % 2)
    cols = 8 * (j // 2) + 2 * (lane % 4) + h
    return tuple(np.broadcast_arrays(rows, cols))


def layout_checks(n):
    """The layout claims of topic 5, checked for every thread of a warpgroup at wgmma width n."""
    rows, cols = accumulator_coords(n)
    lanes = np.broadcast_to(np.arange(GROUP)[:, None], rows.shape)
    checks = {}
    # Every element of the 64 x n tile is held once.
    owners = np.zeros((64, n), dtype=int)
    np.add.at(owners, (rows, cols), 1)
    checks["each element of D in exactly one register of one thread"] = bool((owners == 1).all())
    # The threads holding a row are the 4 lanes of one quad.
    quads = all(
        len(set(lanes[rows == row] // 4)) == 1 and len(set(lanes[rows == row])) == 4 for row in range(64)
    )
    checks["each row held by the 4 lanes of one quad (reductions: 2 shuffles)"] = quads
    # pack_p: P's register 4 s + j = S's registers 8 s + 2 j (low half) and 8 s + 2 j + 1 (high half).
    a_rows, a_cols = rs_a_coords()
    same = True
    for s in range(n // 16):
        for j in range(4):
            for h in range(2):
                reg = 8 * s + 2 * j + h
                same &= bool((rows[:, reg] == a_rows[:, 2 * j + h]).all())
                same &= bool((cols[:, reg] == 16 * s + a_cols[:, 2 * j + h]).all())
    checks["S's k16 slice s packed in pairs = P's A registers of k-step s (no shuffles)"] = same
    return checks


def fragment_facts(config):
    n = config.block_n
    rows, cols = accumulator_coords(n)
    print(f"  S is 64 x {n} per consumer: {n // 2} registers per thread. Warp 0, first 4 registers:")
    for t in (0, 1, 2, 3, 4, 31):
        held = ", ".join(f"r{r}=({rows[t, r]},{cols[t, r]})" for r in range(4))
        print(f"    lane {t:2d} (g={t // 4}, q4={t % 4}): {held} ...")
    checks = layout_checks(n)
    for claim, ok in checks.items():
        print(f"  {'yes' if ok else 'NO '}  {claim}")
    return all(checks.values())


# ---------------------------------------------------------------------------------------------------
# The probe: one warpgroup, one mbarrier, three TMA boxes and one wgmma, to check topics 2-6 on the
# emulation or the hardware. The tiles are 64 x 64 16-bit values (one 128-byte row each):
#   ids     uint16 64 r + c: shows where the swizzled copy puts each element;
#   q, k    q[r, 0] = r, q[r, 1] = 1, k[c, 0] = 64, k[c, 1] = c, the rest 0, so that S = q k^T has
#           S[r, c] = 64 r + c: each accumulator register shows which (row, column) it holds.
# ---------------------------------------------------------------------------------------------------

PROBE_N = 64
PROBE_ELEMS = 64 * 64
PROBE_BYTES = PROBE_ELEMS * 2
PROBE_REGS = PROBE_N // 2

TILE_ALIGNMENT = H.TILE_ALIGNMENT  # a global: Numba takes the alignment as a literal
probe_wgmma = H.make_wgmma_ss(PROBE_N, "f16", 0)


@cuda.jit
@unroll
def probe_kernel(maps, image_out, s_out):
    t = cuda.threadIdx.x
    ids = cuda.shared.array(PROBE_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    q_tile = cuda.shared.array(PROBE_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    k_tile = cuda.shared.array(PROBE_ELEMS, uint16, alignment=TILE_ALIGNMENT)
    bar_word = cuda.shared.array(1, uint64)
    bar = shared_address(bar_word)
    if t == 0:
        H.mbarrier_init(bar, 1)  # one arrival: thread 0's expect_tx
        H.fence_mbarrier_init()
    cuda.syncthreads()  # the barrier exists before anyone waits on it
    if t == 0:
        base = H.array_address(maps)
        for m in static_range(3):
            H.fence_proxy_tensormap_acquire(base + 128 * m)  # the maps were copied from the host
        H.mbarrier_arrive_expect_tx(bar, 3 * PROBE_BYTES)  # phase 0 completes when all 3 boxes land
        H.tma_load_4d(shared_address(ids), base, 0, 0, 0, 0, bar)
        H.tma_load_4d(shared_address(q_tile), base + 128, 0, 0, 0, 0, bar)
        H.tma_load_4d(shared_address(k_tile), base + 256, 0, 0, 0, 0, bar)
    H.mbarrier_wait(bar, 0)  # phase 0 (parity 0) has completed: the tiles are in
    for i in range(t, PROBE_ELEMS, GROUP):
        image_out[i] = ids[i]
    desc_q = H.smem_descriptor(shared_address(q_tile), 16, 1024, H.SWIZZLE_128B)
    desc_k = H.smem_descriptor(shared_address(k_tile), 16, 1024, H.SWIZZLE_128B)
    zero = cuda.local.array(PROBE_REGS, float32)
    for r in static_range(PROBE_REGS):
        zero[r] = float32(0)
    acc = H.fence_operands(H.registers_from(zero, PROBE_REGS))
    H.wgmma_fence()  # the accumulator's registers are written before wgmma reads them
    for kk in static_range(4):  # 4 k16 steps: 32 bytes along the 128-byte rows each
        acc = probe_wgmma(acc, desc_q + uint64(kk * 32 >> 4), desc_k + uint64(kk * 32 >> 4),
                          uint32(0 if kk == 0 else 1))
    H.wgmma_commit()
    H.wgmma_wait(0)  # the product has landed
    H.registers_to(s_out[t], H.fence_operands(acc))


def run_probe():
    """Launch the probe; returns {claim: checked} for the swizzle and the fragment layout."""
    ids = (64 * np.arange(64)[:, None] + np.arange(64)[None, :]).astype(np.uint16)
    q = np.zeros((64, 64), np.float16)
    k = np.zeros((64, 64), np.float16)
    q[:, 0], q[:, 1] = np.arange(64), 1
    k[:, 0], k[:, 1] = 64, np.arange(64)
    host = [x.reshape(1, 64, 1, 64) for x in (ids, q, k)]  # (batch, seqlen, heads, headdim), as q, k, v
    xp = np if _common.SIMULATOR else _common.cupy
    arrays = [xp.asarray(x) for x in host]  # the maps name these: keep them alive past the launch
    words = np.stack([H.tensor_map_4d_words(x, (1, 64, 1, 64), H.SWIZZLE_128B) for x in arrays])
    maps = xp.asarray(words)
    image = xp.zeros(PROBE_ELEMS, np.uint16)
    s = xp.full((GROUP, PROBE_REGS), np.nan, np.float32)
    probe_kernel[1, GROUP](maps, image, s)
    image = np.asarray(image if _common.SIMULATOR else image.get())
    s = np.asarray(s if _common.SIMULATOR else s.get())
    r, c = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    rows, cols = accumulator_coords(PROBE_N)
    return {
        "the TMA box landed swizzled: (r, c) at 64 r + 8 ((c // 8) ^ (r % 8)) + c % 8":
            bool((image[swizzled_offset(r, c)] == ids).all()),
        "wgmma SS through 128B descriptors: register r of thread t holds S[row, col] as stated":
            bool((s == 64 * rows + cols).all()),
    }


# ---------------------------------------------------------------------------------------------------
# The library's kernel on one problem.
# ---------------------------------------------------------------------------------------------------


class Sm90Problem:
    """q, k, v (batch, seqlen, nheads, headdim) float16: in the simulator one head, on a GPU
    flash-attn's benchmark grid (hidden 2048, 16k tokens per batch)."""

    def __init__(self, seqlen_q, seqlen_k, headdim, causal):
        if _common.SIMULATOR:
            self.batch, self.nheads = 1, 1
        else:
            self.batch, self.nheads = max(1, 16384 // seqlen_q), max(1, 2048 // headdim)
        self.seqlen_q, self.seqlen_k, self.headdim, self.causal = seqlen_q, seqlen_k, headdim, causal
        rng = np.random.default_rng(0)
        shapes = [(self.batch, seqlen_q, self.nheads, headdim)] + [(self.batch, seqlen_k, self.nheads, headdim)] * 2
        self.shapes = shapes
        self._rng = rng
        self._host = self._arrays = None

    @property
    def host(self):
        if self._host is None:
            self._host = [self._rng.standard_normal(shape, np.float32).astype(np.float16) for shape in self.shapes]
        return self._host

    @property
    def arrays(self):
        if self._arrays is None:
            self._arrays = self.host if _common.SIMULATOR else [_common.cupy.asarray(x) for x in self.host]
        return self._arrays

    def run(self, family):
        import nbflash

        with nbflash.kernel_family(family):
            return nbflash.flash_attn_func(*self.arrays, causal=self.causal)

    def explain(self, family):
        import nbflash

        with nbflash.kernel_family(family):
            return nbflash.explain(*self.arrays, causal=self.causal)

    def flops(self):
        """4 x batch x heads x (query, key) pairs the mask keeps x headdim."""
        keys = np.arange(self.seqlen_q) + self.seqlen_k - self.seqlen_q + 1 if self.causal else self.seqlen_k
        pairs = int(np.clip(keys, 0, self.seqlen_k).sum()) if self.causal else self.seqlen_q * self.seqlen_k
        return 4 * self.batch * self.nheads * pairs * self.headdim

    def check(self, out, rows=256):
        """(max error, allowed) against float64: the whole output in the simulator; on a GPU the last
        ``rows`` query rows of batch 0, head 0 (with bottom-right causal alignment the last rows
        against all keys keep their mask)."""
        from nbflash.reference import attention_naive, attention_reference

        cut = 0 if _common.SIMULATOR else max(0, self.seqlen_q - rows)
        q, k, v = (x[:1, :, :1] for x in self.host)
        q, got = q[:, cut:], out[:1, cut:, :1]
        got = np.asarray(got if _common.SIMULATOR else got.get(), dtype=np.float64)
        exact = attention_reference(q, k, v, causal=self.causal)
        naive = attention_naive(q, k, v, causal=self.causal)
        error = float(np.max(np.abs(got - exact)))
        allowed = 2 * float(np.max(np.abs(naive.astype(np.float64) - exact))) + 1e-5  # flash-attn's rule
        return error, allowed


def sm90_runs_here():
    """None when nbflash's sm90 kernel can run here, else why not."""
    if _common.SIMULATOR:
        return None
    if _common.cupy is None:
        return "nbflash needs CuPy on a GPU"
    if cuda.get_current_device().compute_capability != (9, 0):
        return "the sm90 kernel runs on compute capability 9.0 (H100, H200) only"
    return None


def config_of(info):
    """The Sm90ForwardConfig that ``nbflash.explain`` reports."""
    from nbflash.kernels.forward_sm90 import Sm90ForwardConfig

    names = {f.name for f in dataclasses.fields(Sm90ForwardConfig)}
    return Sm90ForwardConfig(**{name: value for name, value in info["config"].items() if name in names})


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Print the reading guide, check its layout claims and run the library's kernel. Returns a dict:
    ``missing`` (anchors not found in the files), ``layout`` (the claims of topic 5, checked in
    Python), ``probe`` ({claim: checked} from the probe kernel) and ``error`` and ``allowed`` (the
    library's kernel against float64); the last three are None where no sm90 kernel can run."""
    seqlen_q = seqlen_q or (32 if _common.SIMULATOR else _common.DEFAULT_SEQLEN)
    seqlen_k = seqlen_k or seqlen_q
    headdim = headdim or _common.DEFAULT_HEADDIM
    if headdim % 8 or not 8 <= headdim <= 256:
        raise ValueError(f"{headdim=}: the sm90 kernel serves multiples of 8 up to 256 (nbflash runs other "
                         "headdims on the mma family)")
    result = dict(missing=[], layout=None, probe=None, error=None, allowed=None)
    why_not = sm90_runs_here()
    problem = Sm90Problem(seqlen_q, seqlen_k, headdim, causal)

    print("lesson 08: reading nbflash's Hopper forward kernel (nbflash/kernels/forward_sm90.py)")
    print("  Open the kernel file beside this printout; its docstring has the loop, the grid and the layouts.")
    if why_not:
        from nbflash import configs
        from nbflash.problem import Variant

        config = configs.sm90_forward_config("float16", headdim, Variant(window=causal))
        info = None
        print(f"  Not run here ({why_not}); the guide shows the config a Hopper GPU would plan.")
    else:
        info = problem.explain("sm90")
        config = config_of(info)
    print(f"\nThe problem: q {problem.shapes[0]}, k and v {problem.shapes[1]}, float16, causal={causal}")
    print(f"  planned config: block_m {config.block_m}, block_n {config.block_n}, stages {config.stages},"
          f" consumers {config.consumers}, overlap {config.overlap}, pingpong {config.pingpong}")
    if info:
        extra = (f", {info['registers']} registers per thread reported (the entry cap; after setmaxnreg the"
                 f" consumers' code may use up to {config.consumer_registers})") if info.get("registers") else ""
        print(f"  grid {info['grid']}, block {info['block']}, {info['dynamic_shared_bytes']} bytes of dynamic"
              f" shared memory{extra}")
    n_tiles = max(1, -(-seqlen_k // config.block_n))
    facts = {
        1: lambda: registers_facts(config),
        2: lambda: ring_facts(config, min(max(n_tiles, config.stages + 2), 6), n_tiles),
        3: swizzle_facts,
        4: lambda: descriptor_facts(config),
        5: lambda: fragment_facts(config),
    }
    for number, (title, text, anchors) in enumerate(TOPICS, start=1):
        print(f"\n{title}")
        say(text)
        if number in facts:
            value = facts[number]()
            if number == 5:
                result["layout"] = value
        result["missing"] += print_anchors(anchors)

    print("\nThe probe: one warpgroup, three TMA boxes on one mbarrier, one SS wgmma (this lesson's kernel)")
    if why_not:
        print(f"  not run: {why_not}")
    else:
        result["probe"] = run_probe()
        for claim, ok in result["probe"].items():
            print(f"  {'yes' if ok else 'NO '}  {claim}")

    print("\nThe library's kernel, through nbflash.kernel_family('sm90'):")
    if why_not:
        print(f"  not run: {why_not}")
    else:
        start = time.perf_counter()
        out = problem.run("sm90")  # the first call compiles the kernel
        seconds = time.perf_counter() - start if _common.SIMULATOR else _common.measure(lambda: problem.run("sm90"))
        result["error"], result["allowed"] = problem.check(out)
        what = "every row" if _common.SIMULATOR else "the last 256 rows of batch 0, head 0"
        print(f"  max |out - float64|        {result['error']:.2e}   (allowed: 2 x naive fp16 + 1e-5 ="
              f" {result['allowed']:.2e}; {what})")
        if _common.SIMULATOR:
            print(f"  time per call              {seconds * 1e3:.3f} ms (simulator: Python threads, not a GPU)")
            print("  mma family: not timed; simulator times measure Python, not the tensor cores")
        else:
            mma = _common.measure(lambda: problem.run("mma"))
            flops = problem.flops()
            print(f"  time per call              sm90 {seconds * 1e3:.3f} ms ({flops / seconds / 1e12:.0f} TFLOP/s),"
                  f" mma {mma * 1e3:.3f} ms ({flops / mma / 1e12:.0f} TFLOP/s): sm90 {mma / seconds:.2f}x")
    print("\nnext: the exercises in docs/workshop.md; then tests/test_forward_sm90.py and"
          " tests/test_primitives_sm90.py, which check the same kernel and primitives.")
    return result


if __name__ == "__main__":
    try:
        main(**_common.cli(__doc__))
    except ValueError as error:  # a headdim the sm90 kernel does not serve: say so, no traceback
        sys.exit(f"lesson 08: {error}")
