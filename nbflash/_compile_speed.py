"""Faster, equivalent stand-ins for parts of numba-cuda's compiler, applied at import.

The tensor-core kernels are unrolled in Python (``primitives.unroll``), so their Numba IR has blocks
of thousands of statements, most of them reads and writes of register tiles (``cuda.local.array``)
at constant indices. Two of numba-cuda's costs grow with that, for work whose result a cheaper
computation gives exactly:

``Lower._find_singly_assigned_variable`` (before a function is lowered) finds the variables that
may live in registers without a stack slot: those assigned in exactly one block, used in no other,
not needing an alloca, and assigned exactly once in their block. It checks the last condition by
scanning the whole block once per candidate variable: quadratic in the block's size (for the hd 128
causal dK/dV kernel, 13 of a 52 s compile on 2 cores). ``find_singly_assigned_variables`` counts
the assignments to each name of a block once (a ``Counter`` over the same
``Block.find_insts(ir.assign_types)``) and reads the counts for every candidate; everything else is
the original's code in its order (the same ``compute_use_defs`` and ``must_use_alloca``, the same
candidate test), so it computes the same set and sets the same attributes.

``a[0, 1, 2]`` (an element of an array, at indices that are constants in the IR) is a
``static_getitem`` (``a[0, 1, 2] = x``: a ``static_setitem``). numba-cuda first looks for a lowering
of ``static_getitem`` for arrays, finds none (after reloading every registry), and falls back on
the generic ``getitem``: it re-types the call, builds the array's structure on the stack, unpacks
its shape and strides, wraps each index for negative values, and so on: about 70 LLVM instructions
per element (milliseconds of Python each), that NVVM then folds away. ``_lowering_element_access``
wraps ``Lower.lower_expr`` and ``Lower.lower_inst`` to lower that case directly, for what the
generic path computes there: one element of a C-contiguous array, at integer constants (negative
ones wrapped, as the generic path wraps them), the call typed as the generic path had it. The
element's address is the generic path's, ``data + sum(index[k] * prod(shape[k + 1:]))`` (in Horner
form: the same integer, mod 2**64), loaded or stored by numba-cuda's own ``load_item`` /
``store_item`` after the same casts. Anything else (a view, another layout, an optional array)
goes to numba-cuda's code as before. LLVM IR shrinks, and NVVM takes less than half the time. The
PTX of nbflash's kernels is byte-identical with and without it, except the hd 128 causal dK/dV and
dQ kernels', which NVVM numbers a few virtual registers differently in (same ptxas registers,
spills and stack; the same SASS but for a few instructions' order).

Typing a call looks up the overload's implementation in a cache keyed by the call's types and the
compile's flags (``templates._OverloadMethodTemplate._get_impl`` and its kin): each lookup hashes a
``TargetConfig`` and, on a hit, compares two. ``TargetConfig.__hash__`` is the hash of its sorted
option names (``sorted(self.values())`` sorts the keys of a dict of every option), the same for
every instance of a class, computed by building that dict of ~30 options each time;
``__eq__`` builds two such dicts. ``config_hash`` returns the same number from the class's option
names, computed once per class; ``config_eq`` compares two configs of one class by their set
values over the class's defaults (an option's value is its set value, else its default: the
getter the metaclass makes), at once when the set values are equal, and configs of two classes
through ``values()`` as before. About a seventh of the profiled calls of an unrolled kernel's
compile went to those two.

``tests/test_compile_speed.py`` checks each against numba-cuda's own code: the variable scan on
the IR of nbflash's kernels; the element lowerings by running both on the CPU (llvmlite's JIT) for
random shapes and indices, and, where NVVM is installed, by the PTX of a kernel compiled with and
without. ``apply()`` installs each only over the exact numba-cuda code it was checked against: a
version in ``TESTED`` and the sha256 of the source of what it replaces or reproduces. With another
numba-cuda, or ``NBFLASH_COMPILE_PATCH=0`` in the environment, numba-cuda's own code runs. Under
Numba's simulator there is no compiler, and nothing is patched.
"""

import hashlib
import inspect
import os
from collections import Counter, defaultdict

# numba-cuda versions these were checked against (setup.cfg pins numba-cuda to 0.30.x).
TESTED = ("0.30.",)

_state = {"applied": {}, "originals": {}, "reason": "not applied yet"}


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


def _constant_index(aryty, index):
    """``index`` (a static index as the IR holds it: an int or a tuple) as a tuple of ints naming one
    element of ``aryty``, when that is a C-contiguous array; else None."""
    from numba.cuda import types

    if type(index) is int:
        index = (index,)
    if not (isinstance(aryty, types.Array) and aryty.layout == "C" and isinstance(index, tuple)
            and len(index) == aryty.ndim > 0 and all(type(i) is int for i in index)):
        return None
    return index


def _element_pointer(context, builder, aryty, ary, index):
    """The address of ``ary[index]`` (``index``: ints, as ``_constant_index`` gives them)."""
    from llvmlite import ir as llvm_ir

    intp = llvm_ir.IntType(64)
    model = context.data_model_manager[aryty]
    data = builder.extract_value(ary, model.get_field_position("data"))
    shape = builder.extract_value(ary, model.get_field_position("shape"))
    loc = None
    for axis, i in enumerate(index):
        dim = builder.extract_value(shape, axis) if axis or i < 0 else None
        step = intp(i) if i >= 0 else builder.add(dim, intp(i))  # a negative index counts from the end
        loc = step if loc is None else builder.add(builder.mul(loc, dim), step)
    return builder.gep(data, [loc])


def _lowering_element_access(lower_expr, lower_inst):
    """``Lower.lower_expr`` and ``Lower.lower_inst`` that lower one element of a C-contiguous array
    at integer constants (a ``static_getitem`` expression, a ``static_setitem`` statement) directly,
    and pass everything else to numba-cuda's."""
    from numba.cuda.core import ir
    from numba.cuda.np import arrayobj

    def lower_expr_fast(self, resty, expr):
        if expr.op == "static_getitem":
            aryty = self.typeof(expr.value.name)
            index = _constant_index(aryty, expr.index)
            signature = self.fndesc.calltypes.get(expr) if index and expr.index_var is not None else None
            if signature is not None and signature.args[0] == aryty and signature.return_type == aryty.dtype:
                # numba-cuda: no static_getitem lowering for arrays, so lower_getitem(), which loads
                # the element (getitem_array_tuple) and casts it from the call's type to resty
                ary = self.loadvar(expr.value.name)
                pointer = _element_pointer(self.context, self.builder, aryty, ary, index)
                value = arrayobj.load_item(self.context, self.builder, aryty, pointer)
                return self.context.cast(self.builder, value, signature.return_type, resty)
        return lower_expr(self, resty, expr)

    def lower_inst_fast(self, inst):
        if isinstance(inst, ir.staticsetitem_types):
            aryty = self.typeof(inst.target.name)
            index = _constant_index(aryty, inst.index)
            signature = self.fndesc.calltypes[inst]
            if index is not None and signature.args[0] == aryty:
                # numba-cuda: no static_setitem lowering for arrays, so lower_setitem(), which casts
                # the value to the call's type, and setitem_array() from that to the array's dtype
                ary = self.loadvar(inst.target.name)
                value = self.context.cast(self.builder, self.loadvar(inst.value.name), self.typeof(inst.value.name),
                                          signature.args[2])
                value = self.context.cast(self.builder, value, signature.args[2], aryty.dtype)
                pointer = _element_pointer(self.context, self.builder, aryty, ary, index)
                arrayobj.store_item(self.context, self.builder, aryty, value, pointer)
                return None
        return lower_inst(self, inst)

    lower_expr_fast.__wrapped__, lower_inst_fast.__wrapped__ = lower_expr, lower_inst
    return lower_expr_fast, lower_inst_fast


_CONFIG_HASHES = {}  # TargetConfig subclass -> the hash of its sorted option names
_CONFIG_DEFAULTS = {}  # TargetConfig subclass -> {option name: default}


def config_hash(self):
    """``TargetConfig.__hash__``'s value: the hash of the sorted option names, once per class."""
    cls = type(self)
    found = _CONFIG_HASHES.get(cls)
    if found is None:
        found = _CONFIG_HASHES[cls] = hash(tuple(sorted(cls.options)))
    return found


def _config_defaults(cls):
    """The default of each option of a TargetConfig class, once per class."""
    found = _CONFIG_DEFAULTS.get(cls)
    if found is None:
        found = _CONFIG_DEFAULTS[cls] = {name: option.default for name, option in cls.options.items()}
    return found


def _config_eq(original_eq):
    from numba.cuda.core.targetconfig import TargetConfig

    def config_eq(self, other):
        """``TargetConfig.__eq__`` (every option's value equal: an option's value is its set value,
        else its default): for two configs of one class, at once when the set values are the same,
        else from the set values over the class's defaults; numba-cuda's comparison otherwise. All
        configs of a class hash alike, so a dict lookup compares every one it meets: the
        comparison's cost is typing's (numba-cuda's reads ~30 properties twice)."""
        if isinstance(other, TargetConfig) and type(self) is type(other):
            mine, theirs = self._values, other._values
            if mine == theirs:
                return True
            defaults = _config_defaults(type(self))
            return {**defaults, **mine} == {**defaults, **theirs}
        return original_eq(self, other)

    return config_eq


def _targets():
    """name -> (install: a function that installs the stand-in and returns the original or an undo,
    [what the equivalence relies on: numba-cuda's functions whose sources are hashed], sha256)."""
    from numba.cuda import cgutils, lowering
    from numba.cuda.core import targetconfig
    from numba.cuda.np import arrayobj

    def scan():
        original = lowering.Lower._find_singly_assigned_variable
        lowering.Lower._find_singly_assigned_variable = find_singly_assigned_variables
        return original

    def element_access():
        originals = lowering.Lower.lower_expr, lowering.Lower.lower_inst
        lowering.Lower.lower_expr, lowering.Lower.lower_inst = _lowering_element_access(*originals)
        return originals

    def config_identity():
        config = targetconfig.TargetConfig
        originals = config.__hash__, config.__eq__
        config.__hash__, config.__eq__ = config_hash, _config_eq(originals[1])
        return originals

    return {
        "config hash and equality": (
            config_identity,
            [targetconfig.TargetConfig.__hash__, targetconfig.TargetConfig.__eq__, targetconfig.TargetConfig.values,
             targetconfig._MetaTargetConfig.__init__],
            "4fa80487cc0c4c30d79a3cb0afdc4a76f2f080a1274dbd86114aa77930a28fcc"),
        "singly assigned variables": (
            scan, [lowering.Lower._find_singly_assigned_variable],
            "c3b499f76517288510a5188fbb59bb96f7ca7d619b0cf4245b5f66a8bd90bbe4"),
        "constant-index element access": (
            element_access,
            [lowering.Lower.lower_expr, lowering.Lower.lower_inst, lowering.Lower.lower_getitem,
             lowering.Lower.lower_setitem, arrayobj.getitem_array_tuple, arrayobj.getitem_arraynd_intp,
             arrayobj.setitem_array, arrayobj.basic_indexing, arrayobj.fix_integer_index, arrayobj.load_item,
             arrayobj.store_item, cgutils.get_item_pointer, cgutils.get_item_pointer2],
            "c5af9821a15a0ba9548f77e2a96b843c05d1bafdbc97a5049e94aeb48d15967e"),
    }


def source_sha256(functions):
    """sha256 of the functions' sources, joined (None when a source cannot be read)."""
    try:
        return hashlib.sha256("".join(inspect.getsource(fn) for fn in functions).encode()).hexdigest()
    except (OSError, TypeError):
        return None


def apply():
    """Install each replacement whose original is the one it was checked against; returns the
    names installed. Idempotent."""
    if _state["applied"]:
        return list(_state["applied"])
    if os.environ.get("NBFLASH_COMPILE_PATCH", "1") == "0":
        _state["reason"] = "NBFLASH_COMPILE_PATCH=0"
        return []
    from numba import config

    if config.ENABLE_CUDASIM:
        _state["reason"] = "Numba's simulator: no compiler"
        return []
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("numba-cuda")
    except PackageNotFoundError:
        installed = "?"
    if not installed.startswith(TESTED):
        _state["reason"] = f"numba-cuda {installed} is not a tested version ({', '.join(TESTED)}x)"
        return []
    reasons = []
    for name, (install, relies_on, sha256) in _targets().items():
        if source_sha256(relies_on) != sha256:
            reasons.append(f"{name}: numba-cuda's code differs from the code it was checked against")
            continue
        _state["originals"][name] = install()
        _state["applied"][name] = True
    _state["reason"] = "; ".join(reasons) or "applied"
    return list(_state["applied"])


def applied():
    """Whether every replacement is installed."""
    return len(_state["applied"]) == len(_targets())


def original(name):
    """numba-cuda's own method(s) that the stand-in ``name`` (a key of ``_targets()``) replaces or
    wraps, installed or not: ``_find_singly_assigned_variable``; ``(lower_expr, lower_inst)``;
    ``(TargetConfig.__hash__, TargetConfig.__eq__)``."""
    if name in _state["originals"]:
        return _state["originals"][name]
    from numba.cuda import lowering

    if name == "singly assigned variables":
        return lowering.Lower._find_singly_assigned_variable
    if name == "config hash and equality":
        from numba.cuda.core.targetconfig import TargetConfig

        return TargetConfig.__hash__, TargetConfig.__eq__
    return lowering.Lower.lower_expr, lowering.Lower.lower_inst
