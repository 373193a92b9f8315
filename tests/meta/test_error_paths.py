"""Bad input gives a clear ValueError / TypeError, never a crash or an exception from deep inside.

Each row is an input a fuzz run of the public API (and of the private _C bindings) found
answered with a KeyError, OverflowError, SystemError or AttributeError, or silently accepted.
Every test asserts the exception type and a fragment of the message that says what is wrong.
"""
import re

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import _C, mesh_utils, optim, train_state
from ctrainstate import random as crandom


def _mesh(shape=(2, 4), names=("x", "y")):
    n = int(np.prod(shape))
    return cts.Mesh(np.array(cts.devices()[:n], dtype=object).reshape(shape), names)


# --- mesh axis names with a NUL character ----------------------------------------------
# The core compares names as C strings: 'x\0y' was taken for 'x', so P('x') passed the C
# spec check on a mesh with axis 'x\0y' and devices_indices_map raised KeyError('x').

NUL_CASES = [
    ("mesh_name", lambda: cts.Mesh(np.array(cts.devices()[:2]), ("x\x00y",))),
    ("mesh_second_name",
     lambda: cts.Mesh(np.array(cts.devices()[:2]).reshape(1, 2), ("x", "x\x00y"))),
    ("make_mesh", lambda: cts.make_mesh((2,), ("a\x00",))),
    ("spec_name", lambda: cts.NamedSharding(_mesh((2,), ("x",)), cts.P("x\x00z"))),
    ("spec_tuple_name", lambda: cts.NamedSharding(_mesh(), cts.P(("x", "y\x00")))),
]


@pytest.mark.parametrize("name,call", NUL_CASES, ids=[c[0] for c in NUL_CASES])
def test_axis_name_with_nul_is_rejected(name, call):
    with pytest.raises(ValueError, match="must not contain a NUL character"):
        call()


# --- integers beyond 64 bits in shapes -------------------------------------------------
# Were OverflowError('int too big to convert') from the argument conversion.

BIG_CASES = [
    ("shard_shape", lambda: cts.NamedSharding(_mesh(), cts.P("x")).shard_shape((4, 2 ** 63)),
     r"array shape: 9223372036854775808 is out of range"),
    ("devices_indices_map",
     lambda: cts.NamedSharding(_mesh(), cts.P()).devices_indices_map((2 ** 64,)),
     r"array shape: 18446744073709551616 is out of range"),
    ("single_device_shard_shape",
     lambda: cts.SingleDeviceSharding(cts.devices()[0]).shard_shape((-2 ** 63 - 1,)),
     r"array shape: -9223372036854775809 is out of range"),
    ("buffer_shape", lambda: _C.Buffer(0, (2 ** 64,), 0), r"shape: 18446744073709551616 is out"),
    ("random_bits_start",
     lambda: _C.random_bits(np.zeros(4, np.uint32), 0, 1, (4,), (2 ** 70,), 32),
     r"start: 1180591620717411303424 is out of range"),
]


@pytest.mark.parametrize("name,call,msg", BIG_CASES, ids=[c[0] for c in BIG_CASES])
def test_shape_entry_beyond_int64_is_a_value_error(name, call, msg):
    with pytest.raises(ValueError, match=msg):
        call()


# --- device arrays whose element count overflows int64 (private mesh_check) ------------
# (2**32, 2**32) wrapped to 0 elements and was accepted with no device ids.

@pytest.mark.parametrize("shape", [(2 ** 32, 2 ** 32), (2 ** 62, 4), (2 ** 31, 2 ** 31, 8)])
def test_mesh_device_count_overflow(shape):
    with pytest.raises(ValueError, match=r"more than 2\*\*63 - 1 elements"):
        _C.mesh_check(shape, ("x", "y", "z")[:len(shape)], [])


def test_mesh_axis_of_size_zero_still_names_the_axis():
    with pytest.raises(ValueError, match="axis 1 has size 0; sizes must be >= 1"):
        _C.mesh_check((2, 0), ("x", "y"), [])


# --- optimizer bindings given a non-tuple where a tuple is expected --------------------
# Were SystemError('new style getargs format but argument is not a tuple').

def _buf():
    return _C.Buffer(0, (4,), 0)


OPTIM_CASES = [
    ("reference_block", lambda: _C.optim_reference((), 4), "an optimizer block must be a"),
    ("reference_stage", lambda: _C.optim_reference([5], (None,) * 7), "stage 0 must be a"),
    ("step_stage", lambda: _C.optim_step([[0, [0.1]]], [], 0), "stage 0 must be a"),
    ("step_block", lambda: _C.optim_step([(0, [0.1])], [[[_buf(), _buf(), None, [], 1, 0, True]]], 1),
     "an optimizer block must be a"),
    ("geometry",
     lambda: _C.optim_reference([(0, [0.1])], (None, _buf(), None, [], 1, 0, True, [0, 1, [2, 2], [0, 0], [2, 2]])),
     "factored geometry must be None or a"),
]


@pytest.mark.parametrize("name,call,msg", OPTIM_CASES, ids=[c[0] for c in OPTIM_CASES])
def test_optim_bindings_reject_non_tuples(name, call, msg):
    with pytest.raises(TypeError, match=msg):
        call()


# --- random.split with a num that is not an integer ------------------------------------
# split(k, inf) raised OverflowError('cannot convert float infinity to integer'), split(k,
# 2**64 - 1) OverflowError('int too big to convert'), and split(k, 2.5) gave 2 keys; as in
# jax (whose shapes must be integers) they are a TypeError / ValueError naming num.

SPLIT_CASES = [
    (float("inf"), TypeError, "split: num must be an integer or a tuple of integers, got inf"),
    (2.5, TypeError, "split: num must be an integer or a tuple of integers, got 2.5"),
    ((2, None), TypeError, r"split: num must be an integer or a tuple of integers, got \(2, None\)"),
    # the message shows repr(num): np.uint64(...) with numpy 2, the bare number with numpy 1
    (np.uint64(2 ** 64 - 1), ValueError,
     r"split: num=" + re.escape(repr(np.uint64(2 ** 64 - 1))) + r" is too large"),
    ((2 ** 40, 2 ** 40), ValueError, r"split: num=\(1099511627776, 1099511627776\) is too large"),
]


@pytest.mark.parametrize("num,exc,msg", SPLIT_CASES, ids=[repr(c[0]) for c in SPLIT_CASES])
def test_split_num_must_be_integers(num, exc, msg):
    with pytest.raises(exc, match=msg):
        crandom.split(crandom.PRNGKey(0), num)


def test_split_integer_likes_still_work():
    k = crandom.PRNGKey(0)
    want = crandom.split(k, 3)
    for num in (np.int64(3), np.array(3), (3,), [np.int32(3)]):
        np.testing.assert_array_equal(crandom.split(k, num), want)


# --- TrainState.create with something that is not an optimizer ------------------------
# Was AttributeError("'NoneType' object has no attribute 'init'").

@pytest.mark.parametrize("tx", [None, "adam", 0.001, optim.adamw], ids=["None", "str", "float", "factory"])
def test_train_state_create_needs_an_optimizer(tx):
    with pytest.raises(TypeError, match=r"TrainState.create: tx must be a gradient transformation"):
        train_state.TrainState.create(apply_fn=None, params={"w": np.ones(4, np.float32)}, tx=tx)


# --- shapes and axis names that are not sequences --------------------------------------
# Were "'int' object is not iterable" / "int() argument must be ..." from inside, naming no
# argument; create_device_mesh((2.5,)) silently took 2.

SEQ_CASES = [
    ("shard_shape_int", lambda: cts.NamedSharding(_mesh(), cts.P()).shard_shape(4),
     TypeError, "a global shape must be a sequence of integers, got 4"),
    ("devices_indices_map_none",
     lambda: cts.SingleDeviceSharding(cts.devices()[0]).devices_indices_map(None),
     TypeError, "a global shape must be a sequence of integers, got None"),
    ("shard_shape_float", lambda: cts.NamedSharding(_mesh(), cts.P()).shard_shape((4, 2.5)),
     TypeError, r"a global shape must be a sequence of integers, got \(4, 2.5\)"),
    ("create_device_mesh_int", lambda: mesh_utils.create_device_mesh(3),
     TypeError, "mesh_shape must be a sequence of integers, got 3"),
    ("create_device_mesh_none_entry", lambda: mesh_utils.create_device_mesh((2, None)),
     TypeError, r"mesh_shape must be a sequence of integers, got \(2, None\)"),
    ("create_device_mesh_float", lambda: mesh_utils.create_device_mesh((2.5,), cts.devices()[:2]),
     TypeError, r"mesh_shape must be a sequence of integers, got \(2.5,\)"),
    ("make_mesh_shape_none", lambda: cts.make_mesh(None, ("x",)),
     TypeError, "make_mesh: axis_shapes must be a sequence of integers, got None"),
    ("make_mesh_names_none", lambda: cts.make_mesh((2,), None),
     TypeError, "make_mesh: axis_names must be a sequence of strings, got None"),
    ("make_mesh_names_int", lambda: cts.make_mesh((2,), 3),
     TypeError, "make_mesh: axis_names must be a sequence of strings, got 3"),
]


@pytest.mark.parametrize("name,call,exc,msg", SEQ_CASES, ids=[c[0] for c in SEQ_CASES])
def test_shape_and_name_arguments_must_be_sequences(name, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# --- private kernels given sizes whose arithmetic wrapped -----------------------------
# The size checks of op_matmul and copy_from_host / copy_to_host computed products and
# sums that a negative stride or a huge size made wrap, and passed: the kernel read and
# wrote outside the buffers (a segfault with a stride of -2**40; heap overflows under ASan).

def _f32(*shape):
    return _C.Buffer(0, shape, 0)


MATMUL_CASES = [
    ("negative_a_stride", (2, 1, 1, 1, -1, 0), "negative size or batch stride"),
    ("huge_negative_a_stride", (2, 1, 1, 1, -2 ** 40, 0), "negative size or batch stride"),
    ("negative_b_stride", (2, 1, 1, 1, 0, -3), "negative size or batch stride"),
    ("negative_batch", (-1, 1, 1, 1, 0, 0), "negative size or batch stride"),
    ("m_times_k_wraps", (1, 2 ** 62, 4, 0, 0, 0), "the operand sizes overflow int64"),
    ("batch_times_m_n_wraps", (2 ** 32, 2 ** 32, 1, 1, 0, 0), "the operand sizes overflow int64"),
    ("stride_wraps", (3, 1, 1, 1, 2 ** 62, 0), "the operand sizes overflow int64"),
]


@pytest.mark.parametrize("name,args,msg", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_matmul_sizes_are_checked_without_overflow(name, args, msg):
    batch, m, n, k, sa, sb = args
    with pytest.raises(ValueError, match=msg):
        _C.op_matmul([_f32(4)], [_f32(4)], [_f32(4)], batch, m, n, k, sa, sb, 0, 0, 1.0, 0.0)


def test_matmul_valid_batched_product_still_runs():
    a, b, c = _f32(2, 2), _f32(2, 2), _f32(2, 2)
    np.frombuffer(a, np.float32)[:] = [1, 2, 3, 4]
    np.frombuffer(b, np.float32)[:] = [10, 20, 30, 40]
    # two 1x1x1 products, strides 2 (a) and 0 (b broadcast): c[0] = 1*10, c[1] = 3*10
    _C.op_matmul([a], [b], [c], 2, 1, 1, 1, 2, 0, 0, 0, 1.0, 0.0)
    assert np.frombuffer(c, np.float32)[:2].tolist() == [10.0, 30.0]


@pytest.mark.parametrize("copy", [_C.copy_from_host, _C.copy_to_host], ids=["from_host", "to_host"])
@pytest.mark.parametrize("start", [2 ** 63 - 2, 2 ** 63 - 4, 5])
def test_host_copy_block_must_fit(copy, start):
    with pytest.raises(ValueError, match="shard block does not fit the host array in dimension 0"):
        copy(_f32(4), np.zeros(8, np.float32), (start,))


# --- random samplers' shape argument ---------------------------------------------------
# normal(k, None) raised "'NoneType' object is not iterable", bernoulli(k, 0.5, (2, None))
# "int() argument must be ... not 'NoneType'", and uniform(k, (2.5,)) gave 2 samples.

RANDOM_SHAPE_CASES = [
    ("normal_none", lambda k: crandom.normal(k, None), "got None"),
    ("bernoulli_none_entry", lambda k: crandom.bernoulli(k, 0.5, (2, None)), r"got \(2, None\)"),
    ("uniform_float", lambda k: crandom.uniform(k, (2.5,)), r"got \(2.5,\)"),
    ("bits_str", lambda k: crandom.bits(k, "ab"), "got 'ab'"),
    ("randint_float", lambda k: crandom.randint(k, (4, 1.0), 0, 5), r"got \(4, 1.0\)"),
]


@pytest.mark.parametrize("name,call,msg", RANDOM_SHAPE_CASES, ids=[c[0] for c in RANDOM_SHAPE_CASES])
def test_random_shape_must_be_integers(name, call, msg):
    with pytest.raises(TypeError, match="shape must be a sequence of integers, " + msg):
        call(crandom.PRNGKey(0))


# --- float32 ops given host operands that hold no numbers ------------------------------
# x + None and x ** None were arrays of NaN, x + '1.5' parsed the string, x * [1, None]
# had a NaN; as in jax (and as the int/bool ops here already did) they are a TypeError.

def _x():
    return cts.device_put(np.zeros(2, np.float32))


NON_NUMBER_CASES = [
    ("add_none", lambda: _x() + None, "got NoneType"),
    ("radd_none", lambda: None + _x(), "got NoneType"),
    ("pow_none", lambda: _x() ** None, "got NoneType"),
    ("add_str", lambda: _x() + "1.5", "got str"),
    ("mul_bytes", lambda: _x() * b"1", "got bytes"),
    ("mul_list_with_none", lambda: _x() * [1, None], "got list"),
    ("sub_object_array", lambda: _x() - np.array([1, None], object), "got ndarray of dtype object"),
    ("maximum_none", lambda: cts.numpy.maximum(_x(), None), "got NoneType"),
]


@pytest.mark.parametrize("name,call,msg", NON_NUMBER_CASES, ids=[c[0] for c in NON_NUMBER_CASES])
def test_float_ops_reject_operands_without_numbers(name, call, msg):
    with pytest.raises(TypeError, match="expected an Array, a numpy array or a Python scalar, " + msg):
        call()


def test_float_ops_still_take_numeric_host_operands():
    x = _x()
    assert np.asarray(x + [1, 2.5]).tolist() == [1.0, 2.5]
    assert np.asarray(x + np.array([True, False])).tolist() == [1.0, 0.0]
    assert np.asarray(x - np.float64(2)).tolist() == [-2.0, -2.0]


# --- ctrainstate.numpy constructors' shape argument ------------------------------------
# zeros((2.5,)) made 2 zeros and zeros(None) raised "'NoneType' object is not iterable".

CNP_SHAPE_CASES = [
    ("zeros_float", lambda: cts.numpy.zeros((2.5,)), r"got \(2.5,\)"),
    ("zeros_none", lambda: cts.numpy.zeros(None), "got None"),
    ("ones_none_entry", lambda: cts.numpy.ones((2, None)), r"got \(2, None\)"),
    ("full_str", lambda: cts.numpy.full("ab", 1.0), "got 'ab'"),
]


@pytest.mark.parametrize("name,call,msg", CNP_SHAPE_CASES, ids=[c[0] for c in CNP_SHAPE_CASES])
def test_numpy_constructor_shape_must_be_integers(name, call, msg):
    with pytest.raises(TypeError, match="shape must be an integer or a sequence of integers, " + msg):
        call()


# --- partitioning.get_axis_names of something that is not an axes collection -----------
# get_axis_names({'a': 3}) raised AttributeError("'int' object has no attribute 'names'"),
# get_axis_names(3) "'int' object is not iterable".

from ctrainstate import partitioning as nn_partitioning  # noqa: E402

AXES_CASES = [
    ("not_a_mapping", 3, "get_axis_names expects a mapping"),
    ("leaf_not_metadata", {"a": 3}, r"get_axis_names: 'a' holds a int \(3\), not AxisMetadata"),
    ("nested_leaf", {"mlp": {"wi_axes": ("embed", "mlp")}},
     r"get_axis_names: 'mlp/wi_axes' holds a tuple"),
]


@pytest.mark.parametrize("name,meta,msg", AXES_CASES, ids=[c[0] for c in AXES_CASES])
def test_get_axis_names_needs_axis_metadata(name, meta, msg):
    with pytest.raises(TypeError, match=msg):
        nn_partitioning.get_axis_names(meta)


# --- transpose axes --------------------------------------------------------------------
# x.transpose(1, -1) of a 0-d Array raised ZeroDivisionError('integer modulo by zero'),
# transpose(x, (None, 2)) "unsupported operand type(s) for %", and transpose(x, (0, 3)) of a
# 2-d Array wrapped 3 to 1 and passed.

TRANSPOSE_CASES = [
    ("scalar_with_axes", (), (1, -1), ValueError, "axis 1 is out of bounds for an array of rank 0"),
    ("axis_wraps", (2, 4), (0, 3), ValueError, "axis 3 is out of bounds for an array of rank 2"),
    ("negative_wraps", (2, 4), (-3, 0), ValueError, "axis -3 is out of bounds for an array of rank 2"),
    ("none_entry", (2, 4), (None, 1), TypeError, r"axes must be a sequence of integers, got \(None, 1\)"),
    ("tuple_entry", (2, 4), ((0, 1), 0), TypeError, "axes must be a sequence of integers"),
    ("float_entry", (2, 4), (1.0, 0), TypeError, "axes must be a sequence of integers"),
]


@pytest.mark.parametrize("name,shape,axes,exc,msg", TRANSPOSE_CASES, ids=[c[0] for c in TRANSPOSE_CASES])
def test_transpose_axes_are_checked(name, shape, axes, exc, msg):
    x = cts.device_put(np.zeros(shape, np.float32))
    with pytest.raises(exc, match="transpose: " + msg):
        cts.numpy.transpose(x, axes)


def test_transpose_negative_axes_still_work():
    x = cts.device_put(np.arange(8, dtype=np.float32).reshape(2, 4))
    np.testing.assert_array_equal(np.asarray(x.transpose(-1, 0)), np.arange(8).reshape(2, 4).T)


# --- split / array_split / einsum arguments --------------------------------------------
# split(-1, ...) and array_split(np_array, ...) raised AttributeError from inside (".shape",
# "._check_alive"), array_split(x, None) "'NoneType' object is not iterable", split(x, [1.5])
# cut at 1, and einsum(x, [0], y, [0]) AttributeError("'Array' object has no attribute
# 'replace'").

def _v():
    return cts.device_put(np.arange(4, dtype=np.float32))


SPLIT_ARG_CASES = [
    ("split_scalar", lambda: cts.numpy.split(-1, [1, 2]), ValueError,
     "split: axis 0 is out of bounds for rank 0"),
    ("array_split_str", lambda: cts.numpy.array_split("float32", 2), TypeError,
     "expected an Array, a numpy array or a Python scalar, got str"),
    ("array_split_none_sections", lambda: cts.numpy.array_split(_v(), None), TypeError,
     "array_split: indices_or_sections must be an int or a sequence of ints, got None"),
    ("split_float_index", lambda: cts.numpy.split(_v(), [1.5]), TypeError,
     r"split: indices_or_sections must be an int or a sequence of ints, got \[1.5\]"),
    ("einsum_sublist_form", lambda: cts.numpy.einsum(_v(), [0], _v(), [0]), TypeError,
     "einsum: the first argument must be a subscripts string"),
]


@pytest.mark.parametrize("name,call,exc,msg", SPLIT_ARG_CASES, ids=[c[0] for c in SPLIT_ARG_CASES])
def test_split_and_einsum_arguments(name, call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_array_split_of_a_numpy_array_works():
    parts = cts.numpy.array_split(np.arange(5.0), [2])
    assert [np.asarray(p).tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0]]


# --- adafactor with params on different placements -------------------------------------
# (Valid input that failed.) scale_by_factored_rms put its (1,) placeholder statistics on the
# first param's mesh: a param sharded over a mesh next to one on a single device made
# apply_gradients raise IndexError('list index out of range'), and a param on device 3 alone
# "optimizer state ... is not sharded like the param".

def _placed_params(kind):
    m = cts.make_mesh((2, 4), ("x", "y"))
    w = np.arange(256 * 128, dtype=np.float32).reshape(256, 128) / 1e4   # factored (>= 128)
    b = np.linspace(-1, 1, 8, dtype=np.float32)
    if kind == "mesh_and_device":
        return {"w": cts.device_put(w, cts.NamedSharding(m, cts.P("x", "y"))),
                "b": cts.device_put(b, cts.devices()[0])}
    if kind == "other_devices":
        return {"w": cts.device_put(w, cts.devices()[3]), "b": cts.device_put(b, cts.devices()[5])}
    return {"w": cts.device_put(w, cts.devices()[0]), "b": cts.device_put(b, cts.devices()[0])}


@pytest.mark.parametrize("kind", ["mesh_and_device", "other_devices"])
def test_adafactor_with_params_on_different_placements(kind):
    def run(params):
        st = train_state.TrainState.create(apply_fn=None, params=params, tx=optim.adafactor(1e-2))
        for _ in range(2):
            st = st.apply_gradients(grads={k: np.full(v.shape, 0.5, np.float32)
                                           for k, v in params.items()})
        return {k: np.asarray(v) for k, v in st.params.items()}
    got, want = run(_placed_params(kind)), run(_placed_params("one_device"))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7)


# --- private bindings that trusted their arguments ---------------------------------------
# Each crashed (SIGFPE, SIGSEGV), hung or answered for the wrong device. They run in a fresh
# interpreter, so a crash fails the test instead of ending pytest.

_BINDING_CASES = r"""
import numpy as np
import ctrainstate as cts
C = cts._C
F32, I32 = 0, 3
def case(name, fn):
    try:
        fn()
        print(name, "returned")
    except (ValueError, TypeError, OverflowError) as e:
        print(name, type(e).__name__, str(e).splitlines()[0])
tab, ids, out = C.Buffer(0, (4, 3), F32), C.Buffer(0, (2,), I32), C.Buffer(0, (2, 3), F32)
C.copy_from_host(ids, np.array([0, 1], np.int32), (0,))
# a row width whose byte size wrapped to 0 divided by zero
case("gather_words", lambda: C.op_gather_rows([tab], [ids], [out], [0], 2**62))
# plan [hit | start | pos] with pos out of the gradient's rows, and a start past the end
plan, g = C.Buffer(0, (5,), I32), C.Buffer(0, (2, 3), F32)
C.copy_from_host(plan, np.array([1, 0, 2, 0, 1 << 30], np.int32), (0,))
case("scatter_pos", lambda: C.op_scatter_add_rows([tab], [plan], [g], [0], 1))
C.copy_from_host(plan, np.array([1, 0, 1 << 30, 0, 1], np.int32), (0,))
case("scatter_start", lambda: C.op_scatter_add_rows([tab], [plan], [g], [0], 1))
C.copy_from_host(plan, np.array([1, 0, 2, 1, 0], np.int32), (0,))
case("scatter_ok", lambda: C.op_scatter_add_rows([tab], [plan], [g], [0], 1))
case("random_bits_object", lambda: C.random_bits(np.empty(16, object), 0, 0, (16,), (0,), 64))
case("random_fill_key", lambda: C.random_fill(np.empty(4, np.float32), 2**32, 0, (4,), (0,), 0,
                                              F32, 0.0, 1.0, 0.0, 0.0, 0.5, None))
case("keys_split_empty", lambda: C.keys_split(np.empty(0, np.uint32), np.empty(0, np.uint32),
                                              2**40))
case("memory_stats", lambda: C.memory_stats(2**32))
case("synchronize", lambda: C.synchronize(-2**40))
case("transpose_perm", lambda: C.op_transpose([tab], [2**32 + 1, 0], [tab]))
case("fill_bits32", lambda: C.fill_bits32([tab], 2**32))
case("reduce_axes", lambda: C.op_reduce([tab], 0, 2**32 + 1, [C.Buffer(0, (3,), F32)]))
case("copy_to_host_object", lambda: C.copy_to_host(ids, np.empty(2, object), (0,)))
case("mesh_ids", lambda: C.mesh_check((1,), ("x",), (2**32,)))
case("set_blas_sgemm", lambda: C.set_blas_sgemm(  # numpy 2: numpy._core; numpy 1: numpy.core
    (getattr(np, "_core", None) or np.core).multiarray._ARRAY_API))
"""


def test_private_bindings_reject_bad_arguments():
    from conftest import run_python
    r = run_python(_BINDING_CASES, {"CTRAINSTATE_NUM_CPU_DEVICES": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    want = {
        "gather_words": "ValueError op_gather_rows: row width",
        "scatter_pos": "ValueError row scatter plan: pos[1]",
        "scatter_start": "ValueError row scatter plan: start[1]",
        "scatter_ok": "returned",
        "random_bits_object": "TypeError out: an array of Python objects",
        "random_fill_key": "OverflowError 4294967296 is not a 32-bit unsigned integer",
        "keys_split_empty": "returned",
        "memory_stats": "OverflowError 4294967296 does not fit in a C int",
        "synchronize": "OverflowError",
        "transpose_perm": "ValueError transpose: axis 4294967297 is out of range",
        "fill_bits32": "OverflowError 4294967296 is not a 32-bit unsigned integer",
        "reduce_axes": "OverflowError",
        "copy_to_host_object": "TypeError the host array holds Python objects",
        "mesh_ids": "OverflowError 4294967296 does not fit in a C int",
        "set_blas_sgemm": "TypeError set_blas_sgemm: the capsule",
    }
    assert set(got) == set(want), r.stdout
    for name, start in want.items():
        assert got[name].startswith(start), (name, got[name])


# --- matmul of empty batched Arrays --------------------------------------------------------
# A batch of 2**40 empty products looped in C for hours; zero-size work returns at once.

def test_matmul_of_empty_batched_arrays_returns_at_once():
    from conftest import run_python
    code = """
import time
import numpy as np
import ctrainstate as cts
cnp = cts.numpy
t0 = time.monotonic()
for a, b in [((2**40, 0, 0), (2**40, 0, 3)), ((2**40, 3, 0), (2**40, 0, 0)),
             ((2**40, 0, 5), (2**40, 5, 0))]:
    z = cnp.zeros(a) @ cnp.zeros(b)
    assert z.shape == (2**40, a[1], b[2]) and np.asarray(z).size == 0
z = cnp.ones((4096, 2, 0)) @ cnp.ones((4096, 0, 3))   # k = 0: zeros, not garbage
assert z.shape == (4096, 2, 3) and not np.asarray(z).any()
print("elapsed %.1f" % (time.monotonic() - t0))
"""
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert float(r.stdout.split()[-1]) < 30, r.stdout


def test_long_batched_matmul_stops_on_keyboard_interrupt():
    # 2**14 products of (8 x 2**20) @ (2**20 x 8): minutes of work; SIGINT after 0.5 s
    from conftest import run_python
    code = """
import os, signal, threading, time
import ctrainstate as cts
C = cts._C
K, batch = 1 << 20, 1 << 14
a, b = C.Buffer(0, (8 * K,), 0), C.Buffer(0, (8 * K,), 0)
C.fill_bits32([a, b], 0)
c = C.Buffer(0, (batch * 64,), 0)
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    C.op_matmul([a], [b], [c], batch, 8, 8, K, 0, 0, 0, 0, 1.0, 0.0)
    print("finished")
except KeyboardInterrupt:
    print("interrupted %.1f" % (time.monotonic() - t0))
"""
    r = run_python(code, {"CTRAINSTATE_NUM_CPU_DEVICES": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("interrupted"), r.stdout
    assert float(r.stdout.split()[-1]) < 20, r.stdout


def test_allreduce_with_a_bad_group_changes_no_shard():
    # the second group's shards differ in size: the first group must not be reduced either
    bufs = [_C.Buffer(i, (4,), 0) for i in range(2)]
    for i, b in enumerate(bufs):
        _C.copy_from_host(b, np.full(4, i + 1, np.float32), (0,))
    bad = [_C.Buffer(2, (4,), 0), _C.Buffer(3, (5,), 0)]
    with pytest.raises(ValueError, match="differ in size"):
        _C.op_allreduce([bufs, bad], 0)
    for i, b in enumerate(bufs):
        h = np.empty(4, np.float32)
        _C.copy_to_host(b, h, (0,))
        np.testing.assert_array_equal(h, np.full(4, i + 1, np.float32))
    _C.op_allreduce([bufs], 0)
    h = np.empty(4, np.float32)
    _C.copy_to_host(bufs[1], h, (0,))
    np.testing.assert_array_equal(h, np.full(4, 3, np.float32))
