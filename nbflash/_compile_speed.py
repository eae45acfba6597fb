"""A faster, equivalent replacement for one of numba-cuda's lowering passes, applied at import.

The tensor-core kernels are unrolled in Python (``primitives.unroll``), so their Numba IR has blocks
of thousands of statements. Before lowering a function, numba-cuda's ``Lower.init`` finds the
variables it may keep in registers without a stack slot (``Lower._find_singly_assigned_variable``):
those assigned in exactly one block, used in no other, not needing an alloca, and assigned exactly
once in their block. It checks the last condition by scanning the whole block once per candidate
variable, which is quadratic in the block's size: for the hd 128 causal forward, tens of millions
of statement visits, a quarter of the compile's Python time.

``find_singly_assigned_variables`` computes the same set with one scan per block: it counts the
assignments to each name in a block once (``collections.Counter`` over the block's assignment
statements, in the order and with the same ``Block.find_insts(ir.assign_types)`` the original uses)
and reads the counts for every candidate. Everything else is the original's code, in its order:
the same ``compute_use_defs`` and ``must_use_alloca`` results, the same candidate test. So the
result is the same set, and the attributes it sets on the lowerer are the same.
``tests/test_compile_speed.py`` checks that on the IR of nbflash's own kernels.

``apply()`` installs it, once, and only over the exact original it was checked against: the
numba-cuda versions in ``TESTED`` and a hash of the original method's source. With another
numba-cuda, or ``NBFLASH_COMPILE_PATCH=0`` in the environment, numba-cuda's own pass runs. Under
Numba's simulator there is no lowering, and nothing is patched.
"""

import hashlib
import inspect
import os
from collections import Counter, defaultdict

# numba-cuda versions whose Lower._find_singly_assigned_variable this replaces (setup.cfg pins
# numba-cuda to 0.30.x), and the sha256 of that method's source in them.
TESTED = ("0.30.",)
ORIGINAL_SOURCE_SHA256 = "c3b499f76517288510a5188fbb59bb96f7ca7d619b0cf4245b5f66a8bd90bbe4"

_state = {"applied": False, "original": None, "reason": "not applied yet"}


def find_singly_assigned_variables(lower):
    """What numba-cuda's ``Lower._find_singly_assigned_variable`` computes, in time linear in the
    function's size: sets ``lower._singly_assigned_vars`` and ``lower._blk_local_varmap``."""
    from numba.cuda import lowering

    func_ir = lower.func_ir
    blocks = func_ir.blocks
    sav = set()
    if not func_ir.func_id.is_generator:
        use_defs = lowering.compute_use_defs(blocks)
        alloca_vars = lowering.must_use_alloca(blocks)
        var_assign_map = defaultdict(set)  # variable -> labels of the blocks that define it
        for blk, vl in use_defs.defmap.items():
            for var in vl:
                var_assign_map[var].add(blk)
        used = set()  # variables some block uses before (or without) defining them
        for vl in use_defs.usemap.values():
            used.update(vl)
        assignments = {}  # block label -> Counter of the target names of its assignments
        for var, defblks in var_assign_map.items():
            if var not in alloca_vars and len(defblks) == 1 and var not in used:
                [defblk] = defblks
                counts = assignments.get(defblk)
                if counts is None:
                    counts = Counter(stmt.target.name for stmt in lower.blocks[defblk].find_insts(lowering.ir.assign_types))
                    assignments[defblk] = counts
                if counts[var] == 1:
                    sav.add(var)
    lower._singly_assigned_vars = sav
    lower._blk_local_varmap = {}


def original_source_sha256(lowering_module):
    """sha256 of the source of ``Lower._find_singly_assigned_variable`` as installed (None when
    the source cannot be read)."""
    fn = _state["original"] or lowering_module.Lower._find_singly_assigned_variable
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def apply():
    """Install the replacement if this numba-cuda is one it was checked against; returns whether it
    is installed. Idempotent."""
    if _state["applied"]:
        return True
    if os.environ.get("NBFLASH_COMPILE_PATCH", "1") == "0":
        _state["reason"] = "NBFLASH_COMPILE_PATCH=0"
        return False
    from numba import config

    if config.ENABLE_CUDASIM:
        _state["reason"] = "Numba's simulator: no lowering"
        return False
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("numba-cuda")
    except PackageNotFoundError:
        installed = "?"
    if not installed.startswith(TESTED):
        _state["reason"] = f"numba-cuda {installed} is not a tested version ({', '.join(TESTED)}x)"
        return False
    from numba.cuda import lowering

    if original_source_sha256(lowering) != ORIGINAL_SOURCE_SHA256:
        _state["reason"] = "numba-cuda's Lower._find_singly_assigned_variable is not the one checked"
        return False
    _state["original"] = lowering.Lower._find_singly_assigned_variable
    lowering.Lower._find_singly_assigned_variable = find_singly_assigned_variables
    _state["applied"], _state["reason"] = True, "applied"
    return True


def applied():
    """Whether the replacement is installed."""
    return _state["applied"]


def original():
    """numba-cuda's own ``Lower._find_singly_assigned_variable`` (for the equivalence test)."""
    if _state["original"] is not None:
        return _state["original"]
    from numba.cuda import lowering

    return lowering.Lower._find_singly_assigned_variable
