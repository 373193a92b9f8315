"""Fuzz of the private bindings (ctrainstate._C): every call with random or ill-formed
arguments either returns or raises one of the documented exception types (DESIGN.md:
"Errors, never crashes"; a private binding is still reachable).

A fixed seed makes the calls the same every run. Each batch runs in a fresh interpreter, so
that a crash (or an abort under tools/sanitize.sh's ASan/UBSan build, whose environment the
child inherits) fails the test instead of killing pytest; a hang ends at run_python's timeout.
The arguments come from a table of each binding's parameter kinds: mostly values of the right
kind with edge cases (negative, 2**32, 2**63, empty, deleted, object, misaligned, read-only
and byte-swapped arrays, wrong lengths), sometimes anything at all, sometimes one argument
too many or too few. Counts stay either small or far beyond memory (2**40 and up), so no call
does hours of legitimate work or allocates gigabytes; devices have a 64 MiB limit.
"""
import pytest

from conftest import run_python

SEED = 20261205
BATCHES = 4
CALLS_PER_BATCH = 1000

_FUZZ = r'''
import faulthandler, math, random, sys
faulthandler.enable()
import numpy as np
import ctrainstate as cts
C = cts._C
print("module", C.__file__, flush=True)

ALLOWED = (ValueError, TypeError, OverflowError, RuntimeError, MemoryError, BufferError,
           cts.DonatedBufferError)
rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else SEED_BATCH)

# --- argument pools --------------------------------------------------------------------
SMALL = [0, 1, 2, 3, 4, 5, 7, 8, -1, -2]
EDGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -2**31, -2**63, -2**63 - 1]
HUGE = [2**40, 2**40 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -2**40]
FLOATS = [0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, 1e300, math.inf, -math.inf, math.nan]
JUNK = [None, "x", "", b"a", 1.5, [], (), {}, object(), np.float32(2), [None], ["a"], (1, "a"),
        np.int64(3), True, -1, 0, 2**40, 2**64, int]

ndev = len(C.device_ids("cpu"))
SHAPES = [(), (0,), (1,), (3,), (4,), (5,), (6,), (2, 3), (3, 2), (4, 3), (3, 4), (2, 2, 2),
          (8, 8), (0, 3), (3, 0), (1, 1, 1, 1)]
buffers = []
for dev in range(ndev):
    for dt in range(6):
        for sh in SHAPES:
            buffers.append(C.Buffer(dev, sh, dt))
for b in buffers:
    if b.nbytes % 4 == 0 and b.nbytes // max(1, int(np.prod(b.shape))) == 4:
        C.fill_bits32([b], rng.choice([0, 0x3F800000, 0x7FC00000, 1, 5]))
    elif b.nbytes:
        item = b.nbytes // int(np.prod(b.shape))
        C.copy_from_host(b, np.ones(b.shape, f"u{item}"), (0,) * len(b.shape))
by_key = {}
for b in buffers:
    by_key.setdefault((b.device_id, b.shape, b.dtype), b)
dead = C.Buffer(0, (4,), 0)
dead.delete()
buffers.append(dead)

# one call's shared choices: most list arguments then have one length and buffers of one
# shape and dtype (one per device), so that calls get past the first checks to the kernels
ctx = {}
def new_ctx():
    ctx["n"] = rng.choice([1, 1, 2])
    ctx["shape"] = rng.choice(SHAPES)
    ctx["dtype"] = rng.choice([0, 0, 0, 3, 4, 5, 1, 2])
    ctx["coherent"] = rng.random() < 0.6

def shard_bufs():
    n = ctx["n"]
    shape = ctx["shape"] if rng.random() < 0.8 else rng.choice(SHAPES)
    return [by_key[(i % ndev, shape, ctx["dtype"])] for i in range(n)]

def host_pool():
    base = np.zeros(64, np.uint8)
    ro = np.zeros((2, 3), np.float32)
    ro.flags.writeable = False
    return [np.zeros((2, 3), np.float32), np.zeros(4, np.float32), np.zeros(6, np.uint32),
            np.zeros(4, np.int32), np.zeros((4, 3), np.float32), np.zeros(0, np.float32),
            np.zeros(16, object), np.zeros((2, 3), object), base[1:17].view(np.float32),
            ro, np.zeros(8, np.float32)[::2], np.zeros(4, np.float64), np.zeros(4, ">f4"),
            np.zeros(8, np.uint8), np.zeros((2, 2), np.uint16), np.zeros(4, np.bool_),
            np.zeros(3, [("a", np.int32), ("b", object)]), np.array(5, np.uint32),
            np.arange(4, dtype=np.uint32), np.zeros(2, np.complex64)]

def pick_any():
    r = rng.random()
    if r < 0.3:
        return rng.choice(buffers)
    if r < 0.5:
        return rng.choice(host_pool())
    return rng.choice(JUNK)

def gen(kind):
    if rng.random() < 0.07:
        return pick_any()
    r = rng.random()
    if kind == "int":
        return rng.choice([0, 1, 2, 3]) if r < 0.7 else rng.choice(SMALL + EDGE)
    if kind == "count":
        return rng.choice([0, 1, 2, 3, 4, 6, 8]) if r < 0.7 else rng.choice(SMALL + HUGE)
    if kind == "u32":
        return rng.choice([0, 1, 2, 3, 5]) if r < 0.7 else rng.choice(
            [2**32 - 1, 2**32, -1, 2**64, 0x3F800000])
    if kind == "float":
        return rng.choice(FLOATS)
    if kind == "bool":
        return rng.choice([0, 1, True, False, 2])
    if kind == "buf":
        return rng.choice(buffers)
    if kind == "bufs" and ctx["coherent"]:
        return shard_bufs()
    if kind == "fresh":
        out = [C.Buffer(rng.randrange(ndev), rng.choice(SHAPES), rng.randrange(6))
               for _ in range(rng.choice([0, 1, 2]))]
        return out + ([rng.choice(JUNK)] if rng.random() < 0.1 else [])
    if kind == "buf" and ctx["coherent"]:
        return shard_bufs()[0]
    if kind == "host" and ctx["coherent"]:
        item = {0: np.float32, 1: np.float16, 2: np.uint16, 3: np.int32, 4: np.uint32, 5: np.uint8}
        return np.zeros(ctx["shape"], item[ctx["dtype"]])
    if kind == "ints" and ctx["coherent"] and rng.random() < 0.6:
        return tuple(rng.choice([0, 0, 0, 1]) for _ in ctx["shape"])
    if kind == "bufs":
        n = rng.choice([0, 1, 1, 1, 2, 2, 3])
        out = [rng.choice(buffers) for _ in range(n)]
        if rng.random() < 0.1:
            out.append(rng.choice(JUNK))
        return out if rng.random() < 0.8 else tuple(out)
    if kind == "ints":
        n = rng.choice([0, 1, 2, 2, 3, 3, 4])
        vals = SMALL if rng.random() < 0.8 else SMALL + EDGE
        return tuple(rng.choice(vals) for _ in range(n))
    if kind == "host":
        return rng.choice(host_pool())
    if kind == "keys":
        n = rng.choice([0, 1, 3])
        a = np.arange(n, dtype=np.uint32)
        return a if rng.random() < 0.8 else rng.choice(host_pool())
    if kind == "names":
        return tuple(rng.choice(["x", "y", "z", "", "x\0"]) for _ in range(rng.choice([0, 1, 2])))
    if kind == "spec":
        return tuple(tuple(rng.choice(["x", "y"]) for _ in range(rng.choice([0, 1, 2])))
                     for _ in range(rng.choice([0, 1, 2, 3])))
    if kind == "groups":
        return [gen("bufs") for _ in range(rng.choice([0, 1, 2]))]
    if kind == "stages":
        return [(rng.choice(SMALL + [99]),
                 [rng.choice(FLOATS) for _ in range(rng.choice([0, 2, 4, 9]))])
                for _ in range(rng.choice([0, 1, 2]))]
    if kind == "block":
        geom = None
        if rng.random() < 0.3:
            geom = (rng.choice(SMALL), rng.choice(SMALL), gen("ints"), gen("ints"), gen("ints"))
        nslots = rng.choice([0, 1, 2])
        blk = (rng.choice([None, gen("buf")]), gen("buf"), rng.choice([None, gen("buf")]),
               [rng.choice([None, gen("buf")]) for _ in range(nslots)], gen("u32"),
               rng.choice(SMALL), rng.choice([True, False]))
        return blk + (geom,) if geom is not None or rng.random() < 0.3 else blk
    if kind == "bgroups":
        return [[gen("block") for _ in range(rng.choice([0, 1, 2]))]
                for _ in range(rng.choice([0, 1, 2]))]
    if kind == "rules":
        return rng.choice([(), (("batch", "x"),), (("a", None), ("b", ("x", "y"))), None, "x",
                           ((1, 2),), (("a",),)])
    if kind == "lnames":
        return rng.choice([None, (), ("batch",), ("a", None), ("a", "a"), (1,), "ab"])
    if kind == "dlpack":
        # a DLPack capsule of a numpy array (any dtype, strided, byte-swapped) or a Buffer
        if rng.random() < 0.3:
            try:
                return rng.choice(buffers).__dlpack__()
            except ALLOWED:
                return None
        a = rng.choice(host_pool() + [np.zeros((2, 3), np.float32)[:, ::-1],
                                      np.zeros((3, 2), np.float32).T])
        try:
            return a.__dlpack__()
        except (BufferError, TypeError, ValueError):
            return a
    if kind == "cls":
        return rng.choice([SlotsLike, int, type, object, np.ndarray, cts.Array])
    if kind == "arrays":
        return [slots_like() if rng.random() < 0.7 else pick_any()
                for _ in range(rng.choice([0, 1, 2]))]
    if kind == "capsule":
        # (numpy 2 keeps its C API capsule in numpy._core, numpy 1 in numpy.core)
        core = getattr(np, "_core", None) or np.core
        return rng.choice([None, 1, "x", core.multiarray._ARRAY_API])
    if kind == "str":
        return rng.choice(["cpu", "gpu", "cuda", "", "tpu", "cpu\0"])
    if kind == "op":
        return rng.choice(["sum", "max", "min", "prod", "", "sum\0", None, 0])
    return pick_any()

SIGS = {
    "device_ids": ["str"], "memory_stats": ["int"], "reset_peak_memory_stats": [],
    "synchronize": ["int"], "device_ordinal": ["int"], "forked_single_threaded": [],
    "delete_buffers": ["fresh"], "mesh_check": ["ints", "names", "ints"],
    "layout": ["ints", "names", "ints", "spec", "ints"],
    "copy_from_host": ["buf", "host", "ints"], "copy_to_host": ["buf", "host", "ints"],
    "copy_overlap": ["buf", "ints", "buf", "ints"], "copy_bytes": ["buf", "buf"],
    "gpu_status": [], "devices_set_cuda_backend": ["str"], "move_arrays": ["arrays"], "array_type_extend": ["any"],
    "array_getitem": ["any", "any"], "getitem_cache_info": [],
    "Primitive": ["str", "int", "any", "any", "any"],
    "dlpack_copy_into": ["buf", "dlpack"],
    "fill_bits32": ["bufs", "u32"], "op_convert": ["bufs", "bufs"],
    "op_unary": ["int", "float", "float", "bufs", "bufs"],
    "op_binary": ["int", "bufs", "bufs", "bufs"], "op_reduce": ["bufs", "int", "u32", "bufs"],
    "op_ewise": ["int", "bufs", "bufs", "bufs"], "op_reduce_typed": ["bufs", "int", "u32", "bufs"],
    "op_matmul": ["bufs", "bufs", "bufs", "count", "count", "count", "count", "count", "count",
                  "bool", "bool", "float", "float", "int"],
    "op_allreduce": ["groups", "int"],
    "op_nccl_unique_id": ["buf"], "op_allreduce_ranks": ["bufs", "int", "any", "int", "ints"],
    "op_gather_rows": ["bufs", "bufs", "bufs", "ints", "count"],
    "op_scatter_add_rows": ["bufs", "bufs", "bufs", "ints", "count"],
    "op_transpose": ["bufs", "ints", "bufs"], "set_blas_sgemm": ["capsule"], "gemm_small": ["int", "int"], "has_blas": [],
    "get_axis_rules": [], "set_axis_rules": ["rules"],
    "resolve_logical_axes": ["lnames", "rules", "any"],
    "key_split": ["u32", "u32", "count"], "key_fold_in": ["u32", "u32", "u32"],
    "random_bits": ["host", "u32", "u32", "ints", "ints", "int"],
    "random_fill": ["host", "u32", "u32", "ints", "ints", "int", "int", "float", "float",
                    "float", "float", "float", "any"],
    "random_on_device": ["buf"], "keys_split": ["keys", "keys", "count"],
    "random_keyed": ["host", "keys", "keys", "int", "int", "float", "float", "float", "float",
                     "float", "any"],
    "xla_math": ["int", "host"], "xla_pow": ["host", "host"], "random_cpu_path": [],
    "optim_step": ["stages", "bgroups", "int", "any"], "optim_reference": ["stages", "block"],
    "OptimPlan": ["stages", "bgroups", "bgroups", "int", "arrays", "arrays", "int", "ints",
                  "any", "any"],
    # the step of a plan built by a real TrainState step (plan_parts below)
    "OptimPlan.step": ["arrays", "arrays", "any", "int", "arrays"],
    "tape_backward": ["any", "any", "any", "any"],
    "grad_track": ["any", "any", "any"], "grad_collect": ["any", "any", "any"],
    "filled_like": ["any", "float"],
    "param_hit": ["any", "any", "any", "any"], "param_hit_stats": [], "trace_break": ["any", "any"],
    "ParamWithAxes": ["any"], "LogicalConstraint": ["any"], "ModuleParam": ["any"],
    "ModuleApply": ["any"], "state_step": ["any", "any", "any", "any", "any"], "state_step_probe": ["any"],
    "module_call": ["any", "any", "any", "any"], "module_bind_new": ["any", "any"],
    "ModuleMethod": ["any"], "copy_tree": ["any"], "module_post_init": ["any", "any"],
    "ModuleInit": ["any", "any", "int", "any", "any", "any", "any", "any"],
    "module_release": ["any"], "ModuleBase": [],
    "VjpProgram": ["any", "any", "any", "int"],
    "Program": [], "trace_begin": ["any", "any"], "trace_end": [], "trace_active": [], "tls_changed": [],
    "split_args": ["any", "any"], "int_like": ["any", "int"], "f32_bias_correction": ["float", "any"], "adam_scalars": ["float", "float", "any", "any", "any", "any"],
    "trace_node": ["str", "any", "arrays"], "flatten_spec": ["any", "any"],
    "unflatten_spec": ["any", "arrays"],
    "dist_shutdown": [], "dist_info": [], "dist_allreduce": ["host", "host", "op", "float"],
    "dist_allgather": ["host", "host", "float"],
    "dist_reduce_scatter": ["host", "host", "op", "float"],
    "dist_broadcast": ["host", "int", "float"], "dist_barrier": ["float"],
}
# the bindings _C.pyi lists, less the classes (Buffer's constructor and methods are called
# below) and _rules_set_unconstrained, which sets the sentinel that the Python layer passes
# for PartitionSpec.UNCONSTRAINED (any object is valid there), and dist_initialize, which
# starts MPI (once per process: tests/distributed/test_distributed.py checks its arguments); the other
# dist_* bindings are fuzzed with the engine not initialized
SKIP = {"_rules_set_unconstrained", "ResourceExhaustedError", "DonatedBufferError",
        "ConcretizationTypeError", "Buffer",
        "axis_rules", "dist_initialize", "Array", "dispatch_register",
        "dispatch_register_typed", "devices_set_id_offset",
        "param_hit_setup", "module_setup", "constraint_setup", "module_param_setup",
        "module_apply_setup", "state_step_setup",
        "vjp_register",
        "getitem_register"}
# (Array: the type, not callable as a constructor (tests/array/test_array_type.py);
# dispatch_register (and dispatch_register_typed): replaces the primitives behind the Array's
# operators, which the fuzz itself uses; its argument checks are tested in
# tests/ops/test_dispatch.py (vjp_register's too: it replaces the primitives the backward pass's C rules call);
# getitem_register: replaces the Python op and planner behind Array.__getitem__, set once at
# import; its argument checks are tested in tests/array/test_getitem_fast.py;
# devices_set_id_offset: renumbers the devices once per process, under the fuzz's Arrays;
# its argument checks are tested in tests/distributed/test_global_arrays.py;
# param_hit_setup: replaces the objects partitioning.param_with_axes' C hit path reads, set
# once at import; param_hit itself is fuzzed; module_setup likewise, for nn.module's
# module_call and module_bind_new; constraint_setup likewise, for LogicalConstraint;
# module_param_setup and module_apply_setup likewise, for ModuleParam and ModuleApply, whose
# argument checks are tested in tests/nn/test_apply_fast_paths.py; state_step_setup likewise,
# for state_step, tested in tests/optim/test_optim_plan.py)

class SlotsLike:  # an Array-like class with the Array's field names (move_arrays refuses it)
    __slots__ = ("_shape", "_dtype", "_sharding", "_blocks", "_shard_shape", "_host_scalar",
                 "_base", "_donated")

def slots_like():
    o = SlotsLike()
    for name in SlotsLike.__slots__[:rng.randrange(len(SlotsLike.__slots__) + 1)]:
        setattr(o, name, rng.choice([None, False, True, 1, "x"]))
    return o
public = {n for n in dir(C) if not n.startswith("__") and callable(getattr(C, n))} - SKIP
missing = public - set(SIGS)
assert not missing, f"bindings without a fuzz signature: {sorted(missing)}"

ADAM = [(1, [0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 0.0, 0.19]), (0, [-0.1])]

def plan_buffer():
    # a valid plan [hit | start | pos] of one row hit by both gradient rows, or random words
    b = C.Buffer(0, (5,), 3)
    words = [1, 0, 2, 0, 1] if rng.random() < 0.7 else [rng.choice([-2, 0, 1, 2, 3, 2**31 - 1])
                                                        for _ in range(5)]
    C.copy_from_host(b, np.array(words, np.int32), (0,))
    return b

def B(shape, dtype=0, dev=0):
    return by_key[(dev, shape, dtype)]

# valid calls of the bindings that reach kernels: the fuzz changes one argument of one of them
VALID = {
    "copy_from_host": lambda: [B((2, 3)), np.zeros((2, 3), np.float32), (0, 0)],
    "copy_to_host": lambda: [B((2, 3)), np.zeros((4, 3), np.float32), (2, 0)],
    "copy_overlap": lambda: [B((4, 3)), (0, 0), B((2, 3), 0, 1), (2, 0)],
    "copy_bytes": lambda: [B((2, 3)), B((3, 2), 0, 1)],
    "op_matmul": lambda: [[B((2, 3))], [B((3, 4))], [B((2, 2, 2))], 1, 2, 4, 3, 0, 0, 0, 0, 1.0,
                          0.0, 0],
    "op_gather_rows": lambda: [[B((4, 3))], [B((4,), 3)], [B((4, 3), 0)], [0]],
    "op_scatter_add_rows": lambda: [[B((4, 3))], [plan_buffer()], [B((2, 3))], [0], 1],
    "random_fill": lambda: [np.zeros((2, 3), np.float32), 1, 2, (4, 3), (2, 0), 1, 0, 0.0, 1.0,
                            -2.0, 2.0, 0.5, None],
    "random_bits": lambda: [np.zeros(4, np.uint32), 1, 2, (6,), (2,), 32],
    "random_keyed": lambda: [np.zeros(3, np.float32), np.arange(3, dtype=np.uint32),
                             np.arange(3, dtype=np.uint32), 1, 0, 0.0, 1.0, -2.0, 2.0, 0.5, None],
    "keys_split": lambda: [np.arange(3, dtype=np.uint32), np.arange(3, dtype=np.uint32), 2],
    "op_reduce": lambda: [[B((2, 3))], 0, 1, [B((3,))]],
    "op_reduce_typed": lambda: [[B((2, 3), 3)], 1, 1, [B((3,), 3)]],
    "op_binary": lambda: [0, [B((2, 3))], [B((2, 3))], [B((3,))]],
    "op_ewise": lambda: [0, [B((2, 3), 5)], [B((2, 3), 3)], [B((3,), 3)]],
    "op_unary": lambda: [1, 1.0, 0.0, [B((4, 3))], [B((3, 4))]],
    "op_convert": lambda: [[B((2, 3), 0)], [B((3, 2), 1)]],
    "op_transpose": lambda: [[B((2, 3))], (1, 0), [B((3, 2))]],
    "op_allreduce": lambda: [[[B((2, 3)), B((2, 3), 0, 1)]], 0],
    "fill_bits32": lambda: [[B((2, 3)), B((4,), 4, 1)], 0x3F800000],
    "mesh_check": lambda: [(2,), ("x",), (0, 1)],
    "layout": lambda: [(2,), ("x",), (0, 1), (("x",),), (4, 3)],
    "xla_math": lambda: [0, np.ones(4, np.float32)],
    "dlpack_copy_into": lambda: [B((2, 3)), np.ones((2, 3), np.float32).__dlpack__()],
    "xla_pow": lambda: [np.ones(4, np.float32), np.full(4, 2.0, np.float32)],
    # adam (kind 1: b1 b2 eps eps_root bc1 bc2 mode bc1_next; slots mu, nu) then scale (0),
    # or factored (kind 12: decay_rate_t eps; slots v_row, v_col, v) on a 4 x 3 leaf
    "optim_step": lambda: rng.choice([
        [ADAM, [[(B((2, 3)), B((3, 2)), None, [B((6,)), B((2, 3), 0, 1)], 3, 0, True)]], 1],
        [[(12, [0.8, 1e-30])], [[(B((4, 3)), B((3, 4)), None, [B((4,)), B((3,)), None], 1, 0,
                                  True, (0, 1, (4, 3), (0, 0), (4, 3)))]], 1]]),
    "optim_reference": lambda: [ADAM, (B((2, 3)), B((3, 2)), B((6,)), [B((6,)), B((2, 3))], 3,
                                       0, True)],
}

from ctrainstate import optim as _optim
from ctrainstate.train_state import TrainState as _TS
import threading as _threading

def plan_parts():
    # (plan, its state's Arrays, grads leaves) after one TrainState step of adam (2 stages);
    s = _TS.create(apply_fn=None, params={"w": np.ones(3, np.float32)}, tx=_optim.adam(0.1))
    g = cts.device_put({"w": np.ones(3, np.float32)})
    s = s.apply_gradients(grads=g)
    return s.__dict__["_ct_plan"].fast.cplan, s.__dict__["_ct_cur"], [g["w"]]

_plan = {}
def plan_call(args):
    return _plan["p"].step(*args)

def valid_plan_step():
    if "p" not in _plan or rng.random() < 0.2:
        _plan["p"], _plan["cur"], _plan["g"] = plan_parts()
    return [_plan["p"].arrays, list(_plan["g"]),
            [[0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 0.0, 0.19], [-0.1]], np.int32(2)]

def valid_plan():
    p, cur, g = plan_parts()
    return [[(1, [0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, 0.0, 0.19]), (0, [-0.1])],
            [[(cur[0]._blocks[0][1], None, None, [cur[2]._blocks[0][1], cur[3]._blocks[0][1]],
               3, 0, True)]], [[(0, 0)]], 1, g, list(cur), 1, [1], _threading.Lock(), set()]
VALID["OptimPlan.step"] = valid_plan_step
VALID["OptimPlan"] = valid_plan

names = sorted(SIGS)
bad = 0
for i in range(N_CALLS):
    name = rng.choice(names)
    kinds = list(SIGS[name])
    if name in ("random_bits", "random_fill") and rng.random() < 0.4:
        kinds[0] = "buf"
    new_ctx()
    if name in VALID and rng.random() < 0.6:
        args = VALID[name]()
        if rng.random() < 0.85:
            j = rng.randrange(len(args))
            args[j] = gen(kinds[j]) if rng.random() < 0.7 else pick_any()
    else:
        args = [gen(k) for k in kinds]
    r = rng.random()
    if r < 0.04:
        args.append(pick_any())
    elif r < 0.08 and args:
        args.pop()
    print(i, name, flush=True)
    try:
        if name == "OptimPlan.step":
            if "p" not in _plan:
                _plan["p"], _plan["cur"], _plan["g"] = plan_parts()
            plan_call(args)
        else:
            getattr(C, name)(*args)
    except ALLOWED:
        pass
    except BaseException as e:
        bad += 1
        print(f"BAD {name}{tuple(args)!r}: {type(e).__name__}: {e}", flush=True)
    # a Buffer's DLPack export with odd arguments (the capsule is dropped unused)
    if rng.random() < 0.03:
        try:
            rng.choice(buffers).__dlpack__(stream=gen("any"), max_version=gen("any"),
                                           dl_device=gen("any"), copy=gen("any"))
            rng.choice(buffers).__dlpack_device__()
        except ALLOWED:
            pass
        except BaseException as e:
            bad += 1
            print(f"BAD __dlpack__: {type(e).__name__}: {e}", flush=True)
    # Buffer(): the constructor
    if rng.random() < 0.05:
        try:
            C.Buffer(rng.choice(SMALL + EDGE), gen("ints"), rng.choice(SMALL + EDGE))
        except ALLOWED:
            pass
        except BaseException as e:
            bad += 1
            print(f"BAD Buffer: {type(e).__name__}: {e}", flush=True)
C.set_axis_rules(())
print("done", bad)
sys.exit(1 if bad else 0)
'''


@pytest.mark.parametrize("batch", range(BATCHES))
def test_bindings_fuzz_returns_or_raises_documented_errors(batch):
    code = _FUZZ.replace("SEED_BATCH", str(SEED + batch)).replace("N_CALLS", str(CALLS_PER_BATCH))
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "2",
                          "CTRAINSTATE_CPU_DEVICE_MEMORY": str(64 << 20)})
    tail = "\n".join(r.stdout.splitlines()[-5:])
    # the child fuzzes the build this process tests (under tools/sanitize.sh: the ASan one)
    import ctrainstate as cts
    assert r.stdout.startswith(f"module {cts._C.__file__}\n"), r.stdout[:300] + r.stderr[-3000:]
    assert r.returncode == 0, f"exit {r.returncode}\n{tail}\n{r.stderr[-3000:]}"
    assert "done 0" in r.stdout
    assert [l for l in r.stdout.splitlines() if l.startswith("BAD")] == []
