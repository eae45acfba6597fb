"""Lesson 06: a guided reading of nbflash's tensor-core forward kernel and its tile primitives.

Lesson 05 is FlashAttention-2's algorithm with one thread per query row and scalar float32 FMAs.
nbflash's fast kernel, ``nbflash/kernels/forward_mma.py``, runs the same loop, but a warp computes
16 x 8 tiles of S and O with one tensor-core instruction (``mma.sync``), and the tiles move through
shared memory with ``cp.async`` and ``ldmatrix``. Those instructions are not Python: they are the
tile primitives in ``nbflash/primitives.py``, each an inline-PTX intrinsic on the GPU and a
plain-Python emulation in the simulator, so the very same kernel also runs here on the CPU.

This lesson does not copy that code: it opens the library's files and prints a map of them (where
each phase is, and which lesson it corresponds to), lists the primitives the kernel uses and where
both versions of each are defined, and runs one tiny problem through the library's kernel.
Read the files alongside the printout: every line reference is file:line.

Run: python kernels/06_reading_nbflash.py [--seqlen N] [--seqlen-k M] [--headdim D] [--causal]
"""

import ast
import importlib
import inspect
import os
import re

import _common
import numpy as np

# What each piece of the library's kernel corresponds to in the lessons, by function name.
LESSON_LINKS = {
    "copy_tile_async": "lesson 03's load_tile, with 16-byte cp.async copies that skip the registers",
    "copy_tile_elementwise": "lesson 03's load_tile, element by element (any strides, any headdim)",
    "load_kv_tiles": "lesson 05's K_j, V_j loads, into one of two buffers (the next tile loads "
    "while this one is used)",
    "load_q_fragments": "lesson 05's q_row in registers, as mma.sync A-operand fragments",
    "mma_q_kt": "lesson 04's dot products for S_ij, 16 x 8 outputs per warp instruction",
    "mask_scores": "lesson 04's last_key rule; called only on tiles that cross the diagonal or the end",
    "online_softmax": "lesson 04's online_softmax_step: exp2 with the scale folded in, row max "
    "reduced over the 4 lanes (quad) that share a row",
    "mma_p_v": "lesson 04's acc += P V_j, P packed to 16 bit without leaving registers",
    "write_output": "lesson 05's O_i = acc / l_i, written once, plus the log-sum-exp",
    "forward_mma": "lesson 05's kernel: a block per Q tile, one loop over K/V tiles, causal skip",
}


def where(path, line):
    """A file:line reference relative to the repository."""
    return f"{os.path.relpath(path, os.path.dirname(_common.KERNELS_DIR))}:{line}"


def first_line(text):
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def print_kernel_map(module):
    """Banners, phase comments and device functions of the kernel file, in reading order."""
    path = inspect.getsourcefile(module)
    lines = open(path).read().splitlines()
    functions = {
        node.lineno: node
        for node in ast.walk(ast.parse("\n".join(lines)))
        if isinstance(node, ast.FunctionDef)
    }
    print(f"\nThe kernel file, top to bottom ({where(path, 1)}):")
    for number, text in enumerate(lines, start=1):
        stripped = text.strip()
        if re.fullmatch(r"# -{10,}", stripped) and number < len(lines):
            title = lines[number].strip().lstrip("# ")  # a banner: its title is the next line
            if title and not title.startswith("-"):
                print(f"\n  {where(path, number + 1)}  == {title}")
        elif re.match(r"# -{2,} .* -{2,}$", stripped):  # a phase inside the kernel
            print(f"  {where(path, number)}      phase: {stripped.strip('# -')}")
        elif number in functions and not functions[number].name.startswith("_"):
            name = functions[number].name
            print(f"  {where(path, number)}    {name}: {first_line(ast.get_docstring(functions[number]))}")
            if name in LESSON_LINKS:
                print(f"  {'':{len(where(path, number))}}      compare: {LESSON_LINKS[name]}")


def print_primitives(kernel_module, primitives_module):
    """The primitives the kernel imports, each with its simulator and GPU definitions."""
    kernel_tree = ast.parse(inspect.getsource(kernel_module))
    used = [
        alias.name
        for node in ast.walk(kernel_tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("primitives")
        for alias in node.names
    ]
    path = inspect.getsourcefile(primitives_module)
    tree = ast.parse(open(path).read())
    # Line ranges of the simulator branches (``if SIMULATOR:``) and the GPU branches (``else:``).
    branches = []
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "SIMULATOR":
            branches.append(("simulator", node.body[0].lineno, node.body[-1].end_lineno))
            if node.orelse:
                branches.append(("GPU", node.orelse[0].lineno, node.orelse[-1].end_lineno))
    definitions = {}  # name -> [(line, branch, docstring)]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            names, doc = [node.name], ast.get_docstring(node)
        elif isinstance(node, ast.Assign):
            names, doc = [t.id for t in node.targets if isinstance(t, ast.Name)], None
        else:
            continue
        branch = next((b for b, lo, hi in branches if lo <= node.lineno <= hi), "both")
        for name in names:
            definitions.setdefault(name, []).append((node.lineno, branch, doc))

    print(f"\nThe tile primitives the kernel uses ({where(path, 1)}):")
    for name in used:
        found = sorted(definitions.get(name, []))
        places = ", ".join(f"{branch} {where(path, line)}" for line, branch, _ in found)
        doc = next((first_line(d) for _, _, d in found if d), "")
        print(f"  {name:20s} {places}")
        if doc:
            print(f"  {'':20s} {doc}")


def run_tiny(seqlen_q, seqlen_k, headdim, causal):
    """One fp16 problem through the library's tensor-core kernel; returns (error, allowed) or None."""
    from nbflash import configs, interface, reference, validation

    if not {"mma", "sm80"} & set(getattr(configs, "FAMILIES", ())):
        print("\nSkipping the run: nbflash.configs does not offer the tensor-core family 'sm80' yet.")
        return None
    rng = np.random.default_rng(0)
    shapes = [(1, seqlen_q, 1, headdim)] + [(1, seqlen_k, 1, headdim)] * 2
    host = [rng.standard_normal(shape).astype(np.float16) for shape in shapes]
    arrays = host if _common.SIMULATOR else [_common.cupy.asarray(x) for x in host]
    problem, q, k, v = validation.check_forward(*arrays, None, causal)
    out, _ = interface._flash_attn_forward(problem, q, k, v, family="sm80")
    out = np.asarray(out if _common.SIMULATOR else _common.cupy.asnumpy(out), dtype=np.float64)
    exact = reference.attention_reference(*host, causal=causal)
    naive = reference.attention_naive(*host, causal=causal)
    error = float(np.max(np.abs(out - exact)))
    allowed = 2 * float(np.max(np.abs(naive - exact))) + 1e-5  # flash-attn's rule, plus a floor
    print(f"\nOne call through forward_mma: q {shapes[0]}, k and v {shapes[1]}, float16, causal={causal}")
    print(f"  max |out - float64|        {error:.2e}   (allowed: 2 x naive fp16 + 1e-5 = {allowed:.2e})")
    return error, allowed


def main(seqlen_q=None, seqlen_k=None, headdim=None, causal=False):
    """Print the reading guide and run one tiny call; returns (error, allowed), or None when the
    library's tensor-core kernel is not there (yet) to read or run."""
    try:
        primitives = importlib.import_module("nbflash.primitives")
        forward_mma = importlib.import_module("nbflash.kernels.forward_mma")
    except ImportError as exc:
        print(f"lesson 06 needs nbflash's tensor-core kernel, which is not importable here: {exc}")
        return None
    print("lesson 06: reading nbflash's tensor-core forward kernel")
    print("\nIts docstring: the algorithm, the grid, who holds which rows, the memory layout.\n")
    print(inspect.getdoc(forward_mma))
    print_kernel_map(forward_mma)
    print_primitives(forward_mma, primitives)
    result = run_tiny(seqlen_q or 32, seqlen_k or seqlen_q or 32, headdim or 16, causal)
    print("\nnext: the exercises in docs/workshop.md; then nbflash's tests, tests/test_forward.py.")
    return result


if __name__ == "__main__":
    main(**_common.cli(__doc__))
