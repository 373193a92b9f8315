"""The fused optimizer kernel (``ctrainstate._C.optim_step``) on bfloat16 / float16 buffers.

The kernel loads each array (params, grads, updates, every state slot) in its own dtype,
computes in float32 and rounds what it stores once to that dtype (csrc/core/ct_optim.h). So a
step on 16-bit buffers must give, bit for bit, the float32 kernel run on float32 copies of the
same values, each array it wrote then rounded to its dtype (numpy / ml_dtypes: round to
nearest even). Checked here for AdamW, clip_by_global_norm + AdamW, lamb (trust ratio),
adafactor (factored moments, block and param RMS), apply_if_finite's gate, emit mode (updates
in their own dtype), mixed dtypes (float32 params with bfloat16 moments, bfloat16 params with
float32 grads, float16), a leaf split over two devices and a replicated one; on GPU devices
(when there are some) against the CPU devices' bits.
"""
import ml_dtypes
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import _C
from ctrainstate._src.base import dtypes as _dtypes
from ctrainstate.optim import base
from conftest import assert_same_bits

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _assert_bits(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    # NaNs: any NaN (numpy's and ml_dtypes' roundings keep payloads the kernel canonicalises)
    same = (_bits(got) == _bits(want)) | (np.isnan(got.astype(F32)) & np.isnan(want.astype(F32)))
    bad = np.flatnonzero(~same.ravel())
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} elements differ, e.g. at {bad[:3]}: "
                           f"{got.ravel()[bad[:3]]} vs {want.ravel()[bad[:3]]}")


def _buf(dev, x):
    x = np.ascontiguousarray(x)
    b = _C.Buffer(dev.id, x.shape, _dtypes.code(x.dtype))
    _C.copy_from_host(b, x, (0,) * x.ndim)
    return b


def _read(b, like):
    h = np.empty(like.shape, like.dtype)
    _C.copy_to_host(b, h, (0,) * like.ndim)
    return h


def _adam(t, b1=0.9, b2=0.999, eps=1e-8, nesterov=False):
    return (base.ADAM, (b1, b2, eps, 0.0, 1 - b1 ** t, 1 - b2 ** t, float(nesterov),
                        1 - b1 ** (t + 1)))


class Block:
    """One block of a step: host arrays in their dtypes (p, g, out dtype, slots), where it
    runs (device index, leaf, counts) and its factored geometry (adafactor) or None."""

    def __init__(self, p, g, slots, *, leaf=0, dev=0, counts=True, out_dt=None, geom=None,
                 active=None):
        self.p, self.g, self.slots = p, g, list(slots)
        self.leaf, self.dev, self.counts, self.out_dt, self.geom = leaf, dev, counts, out_dt, geom
        self.active = active


def _run(stages, blocks, nleaves, devices, widen):
    """One step on new buffers made from the blocks' arrays. widen: every array as a float32
    copy (and the updates float32). Returns the stage results and per block (params or
    updates, slots, params) as host arrays."""
    emit = any(b.out_dt is not None for b in blocks)
    groups, bufs = {}, []
    for b in blocks:
        dev = devices[b.dev]
        cv = (lambda x: x.astype(F32)) if widen else (lambda x: x)
        pb, gb = _buf(dev, cv(b.p)), _buf(dev, cv(b.g))
        ob = None
        if emit:
            odt = F32 if widen else b.out_dt
            ob = _buf(dev, np.zeros(b.p.shape, odt))
        sb = [None if s is None else _buf(dev, cv(s)) for s in b.slots]
        active = b.active if b.active is not None else (1 << len(stages)) - 1
        t = (pb, gb, ob, sb, active, b.leaf, b.counts)
        if b.geom is not None:
            t = t + (b.geom,)
        groups.setdefault(b.dev, []).append(t)
        bufs.append((pb, ob, sb))
    results = _C.optim_step(stages, list(groups.values()), nleaves)
    outs = []
    for b, (pb, ob, sb) in zip(blocks, bufs):
        dt = (lambda x: F32) if widen else (lambda x: x.dtype)
        w = _read(ob, np.zeros(b.p.shape, F32 if widen else b.out_dt)) if emit else \
            _read(pb, np.zeros(b.p.shape, dt(b.p)))
        s = [None if x is None else _read(y, np.zeros(x.shape, dt(x))) for x, y in zip(b.slots, sb)]
        outs.append((w, s, _read(pb, np.zeros(b.p.shape, dt(b.p)))))
    return results, outs


def _check_steps(make_stages, blocks, nleaves=None, steps=3, devices=None, grads=None):
    """`steps` steps on the 16-bit blocks, each against the float32 kernel on widened copies
    rounded once; the 16-bit state carries over. Returns the 16-bit outputs of the last step."""
    devices = devices or cts.devices("cpu")
    nleaves = nleaves or (max(b.leaf for b in blocks) + 1)
    rng = np.random.default_rng(7)
    got = None
    for t in range(1, steps + 1):
        if t > 1:
            for b in blocks:
                b.g = (grads(b, t) if grads else
                       (rng.standard_normal(b.g.shape) * 2).astype(b.g.dtype))
        stages = make_stages(t)
        r16, got = _run(stages, blocks, nleaves, devices, widen=False)
        r32, want = _run(stages, blocks, nleaves, devices, widen=True)
        np.testing.assert_array_equal(np.array(r16), np.array(r32), err_msg=f"step {t}: results")
        for i, (b, (w16, s16, _), (w32, s32, _)) in enumerate(zip(blocks, got, want)):
            what = "updates" if b.out_dt is not None else "params"
            _assert_bits(w16, w32.astype(w16.dtype), f"step {t}, block {i}: {what}")
            for q, (x16, x32) in enumerate(zip(s16, s32)):
                if x16 is not None:
                    _assert_bits(x16, x32.astype(x16.dtype), f"step {t}, block {i}: slot {q}")
            if b.out_dt is None:
                b.p = w16
            b.slots = s16
    return got


def _leaf(rng, n, pdt, gdt, sdts, **kw):
    p = rng.standard_normal(n).astype(pdt)
    g = (rng.standard_normal(n) * 2).astype(gdt)
    return Block(p, g, [np.zeros(n, d) for d in sdts], **kw)


def _adamw(t):
    return [_adam(t), (base.DECAY, (0.1,)), (base.SCALE, (-1e-2,))]


# --- AdamW: every dtype combination that optax / ctrainstate produce ---------------------------

@pytest.mark.parametrize("pdt,gdt,mdt,vdt", [
    (BF16, BF16, BF16, BF16),      # all bfloat16: 14 bytes per param
    (F16, F16, F16, F16),
    (F32, F32, BF16, F32),         # optax mu_dtype=bfloat16
    (BF16, F32, F32, F32),         # bfloat16 params, float32 grads and state
    (F16, BF16, BF16, F32),
    (F32, F16, F32, F16),
], ids=lambda d: str(d))
def test_adamw_16bit_operands_are_float32_rounded_once(pdt, gdt, mdt, vdt):
    rng = np.random.default_rng(0)
    # 3 * 2048 + 77: several chunks and a tail; 5: shorter than a vector
    blocks = [_leaf(rng, 3 * 2048 + 77, pdt, gdt, [mdt, vdt], leaf=0),
              _leaf(rng, 5, pdt, gdt, [mdt, vdt], leaf=1)]
    _check_steps(_adamw, blocks)


def test_the_16bit_step_rounds_where_the_float32_one_does_not():
    """A bfloat16 step is not the float32 step: the params and moments it stores are rounded
    (so the comparisons above are not comparing two float32 results)."""
    rng = np.random.default_rng(1)
    b = _leaf(rng, 1000, BF16, BF16, [BF16, BF16])
    stages = _adamw(1)
    _, (got,) = _run(stages, [b], 1, cts.devices("cpu"), widen=False)
    _, (want,) = _run(stages, [b], 1, cts.devices("cpu"), widen=True)
    assert got[0].dtype == BF16 and want[0].dtype == F32
    assert not np.array_equal(got[0].astype(F32), want[0])   # rounded
    np.testing.assert_array_equal(got[0], want[0].astype(BF16))
    assert not np.array_equal(got[0], b.p)                   # and the step moved them


@pytest.mark.parametrize("pdt,gdt,odt", [(BF16, BF16, BF16), (F16, F16, F16), (BF16, F32, F32),
                                         (F32, BF16, F32), (F16, BF16, BF16)])
def test_emit_mode_writes_updates_in_their_dtype(pdt, gdt, odt):
    rng = np.random.default_rng(2)
    blocks = [_leaf(rng, 4099, pdt, gdt, [BF16, F32], out_dt=odt)]
    got = _check_steps(_adamw, blocks)
    assert got[0][0].dtype == odt
    # params are read (weight decay), never written in emit mode
    _, ((_, _, p),) = _run(_adamw(4), blocks, 1, cts.devices("cpu"), widen=False)
    np.testing.assert_array_equal(_bits(p), _bits(blocks[0].p))


# --- reductions: global norm, trust ratio, finite gate ----------------------------------------

@pytest.mark.parametrize("dt", [BF16, F16])
def test_clip_by_global_norm_adamw_on_two_devices(dt):
    """The norm reads 16-bit grads; leaf 0 is split over two devices, leaf 1 replicated
    (counted once): the same norm as float32 on the widened grads, so the same clipping."""
    rng = np.random.default_rng(3)
    n = 2 * 4096 + 10
    blocks = [_leaf(rng, n // 2, dt, dt, [dt, dt], leaf=0, dev=0),
              _leaf(rng, n // 2, dt, dt, [dt, dt], leaf=0, dev=1),
              _leaf(rng, 300, dt, dt, [dt, F32], leaf=1, dev=0)]
    rep = blocks[2]
    blocks.append(Block(rep.p.copy(), rep.g.copy(), [s.copy() for s in rep.slots], leaf=1,
                        dev=1, counts=False))

    def grads(b, t):
        if b is blocks[3]:
            return blocks[2].g   # the replica sees the same grads
        return (np.random.default_rng(10 * t + blocks.index(b)).standard_normal(b.g.shape)
                * 3).astype(b.g.dtype)
    for b in blocks:
        b.g = grads(b, 1)

    def stages(t):
        return [(base.GLOBAL_NORM, (1.0,))] + _adamw(t)
    _check_steps(stages, blocks, grads=grads)
    # the norm the step reports is that of the widened grads (float32 of a double sum)
    g = np.concatenate([b.g.astype(np.float64) for b in blocks[:3]])
    r, _ = _run(stages(4), blocks, 2, cts.devices("cpu"), widen=False)
    assert r[0] == pytest.approx(float(np.float32(np.sqrt((g * g).sum()))), rel=1e-6)


@pytest.mark.parametrize("dt", [BF16, F16])
def test_lamb_trust_ratio_reads_16bit_params(dt):
    rng = np.random.default_rng(4)
    blocks = [_leaf(rng, 2500, dt, dt, [dt, dt], leaf=0), _leaf(rng, 64, dt, F32, [F32, dt], leaf=1)]

    def lamb(t):
        return [_adam(t, eps=1e-6), (base.DECAY, (0.01,)), (base.TRUST_RATIO, (0.0, 1.0, 0.0)),
                (base.SCALE, (-1e-3,))]
    _check_steps(lamb, blocks)


@pytest.mark.parametrize("dt", [BF16, F16])
def test_finite_gate_sees_a_16bit_nan(dt):
    """apply_if_finite: a NaN in 16-bit grads rejects the step (nothing written); finite
    grads pass it."""
    rng = np.random.default_rng(5)
    b = _leaf(rng, 3000, dt, dt, [dt, dt])

    def gated(t):
        return [(base.FINITE_GATE, (3.0, 0.0))] + _adamw(t)
    _check_steps(gated, [b], steps=2)
    p0, s0 = b.p.copy(), [s.copy() for s in b.slots]
    b.g = b.g.copy()
    b.g[1234] = np.nan
    r, ((p, s, _),) = _run(gated(3), [b], 1, cts.devices("cpu"), widen=False)
    assert r[0] == 0.0
    np.testing.assert_array_equal(_bits(p), _bits(p0))
    for x, y in zip(s, s0):
        np.testing.assert_array_equal(_bits(x), _bits(y))


# --- adafactor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pdt,sdt", [(BF16, BF16), (F16, F16), (BF16, F32), (F32, BF16)])
def test_adafactor_factored_moments_16bit(pdt, sdt):
    """scale_by_factored_rms, clip_by_block_rms, scale, scale_by_param_block_rms: a factored
    (40, 300) leaf (v_row, v_col in 16 bits) and an unfactored vector (v in 16 bits)."""
    rng = np.random.default_rng(6)
    shape = (40, 300)
    n = shape[0] * shape[1]
    # optax: d0 is the largest dim (300: axis 1), d1 the second (axis 0); v_row drops d0
    geom = (1, 0, shape, (0, 0), shape)
    fac = Block(rng.standard_normal(n).astype(pdt), (rng.standard_normal(n) * 2).astype(pdt),
                [np.zeros(shape[0], sdt), np.zeros(shape[1], sdt), np.zeros(1, sdt)],
                leaf=0, geom=geom)
    vec = Block(rng.standard_normal(700).astype(pdt), rng.standard_normal(700).astype(pdt),
                [np.zeros(1, sdt), np.zeros(1, sdt), np.zeros(700, sdt)], leaf=1)

    def adafactor(t):
        drt = 1.0 - t ** -0.8
        return [(base.FACTORED, (drt, 1e-30)), (base.BLOCK_RMS, (1.0,)), (base.SCALE, (-1e-2,)),
                (base.PARAM_RMS, (1e-3,))]
    got = _check_steps(adafactor, [fac, vec])
    assert got[0][1][0].dtype == sdt and np.any(got[0][1][0].astype(F32) != 0)   # v_row moved


# --- the binding --------------------------------------------------------------------------------

def test_binding_takes_16bit_buffers_and_refuses_others():
    dev = cts.devices("cpu")[0]
    g = _buf(dev, np.ones(8, BF16))
    p = _buf(dev, np.ones(8, F16))
    _C.optim_step([(base.SCALE, (-1.0,))], [[(p, g, None, [], 1, 0, True)]], 1)
    np.testing.assert_array_equal(_read(p, np.zeros(8, F16)), np.zeros(8, F16))
    i = _buf(dev, np.ones(8, np.int32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got int32"):
        _C.optim_step([(base.SCALE, (1.0,))], [[(i, g, None, [], 1, 0, True)]], 1)
    with pytest.raises(ValueError, match="4 elements, expected 8"):   # counted in elements
        _C.optim_step([(base.SCALE, (1.0,))], [[(_buf(dev, np.ones(4, BF16)), g, None, [], 1, 0,
                                                  True)]], 1)


def test_binding_checks_a_step_across_processes():
    # procs: (rank, nproc, process of each group, timeout); another process's blocks are
    # (n, active, leaf, counts) without buffers. Without ctrainstate.distributed the exchange
    # fails, before anything is written
    dev = cts.devices("cpu")[0]
    g = _buf(dev, np.ones(8, F32))
    p = _buf(dev, np.ones(8, F32))
    stages = [(base.GLOBAL_NORM, (1.0,)), (base.SCALE, (-1.0,))]
    groups = [[(p, g, None, [], 3, 0, True)], [(8, 3, 0, False)]]
    with pytest.raises(TypeError, match="procs must be None or"):
        _C.optim_step(stages, groups, 1, None, [0, 2])
    with pytest.raises(ValueError, match="process 2 of 2"):
        _C.optim_step(stages, groups, 1, None, (2, 2, [0, 1], 5.0))
    with pytest.raises(ValueError, match="1 group processes for 2 groups"):
        _C.optim_step(stages, groups, 1, None, (0, 2, [0], 5.0))
    with pytest.raises(ValueError, match="group 1 on process 3 of 2"):
        _C.optim_step(stages, groups, 1, None, (0, 2, [0, 3], 5.0))
    with pytest.raises(TypeError, match="another process's optimizer block"):
        _C.optim_step(stages, [groups[0], [[8, 3, 0, False]]], 1, None, (0, 2, [0, 1], 5.0))
    with pytest.raises(ValueError, match="distributed.initialize"):
        _C.optim_step(stages, groups, 1, None, (0, 2, [0, 1], 5.0))
    np.testing.assert_array_equal(_read(p, np.zeros(8, F32)), np.ones(8, F32))


def test_reference_takes_16bit_buffers():
    """optim_reference (the plain scalar loop) and optim_step agree on 16-bit buffers."""
    rng = np.random.default_rng(8)
    dev = cts.devices("cpu")[0]
    arrays = [rng.standard_normal(5000).astype(d) for d in (BF16, F16, BF16, F16)]
    a = [_buf(dev, x) for x in arrays]
    b = [_buf(dev, x) for x in arrays]
    _C.optim_step(_adamw(2), [[(a[0], a[1], None, a[2:], 7, 0, True)]], 1)
    _C.optim_reference(_adamw(2), (b[0], b[1], None, b[2:], 7, 0, True))
    for x, y, h in zip(a, b, arrays):
        np.testing.assert_array_equal(_bits(_read(x, h)), _bits(_read(y, h)))


# --- GPU devices: the CPU devices' bits -----------------------------------------------------------

def _gpus():
    try:
        return cts.devices("gpu")
    except RuntimeError:   # no GPU
        return []


# cuda_optim.cu's launch settings (read at each launch): the chain kernels (default), the
# generic kernel, its prefetch / unroll / one-CTA-per-tile forms, the 16-byte form's setting
_SETTINGS = {
    "default": {},
    "generic": {"CTRAINSTATE_OPT_CHAIN": "0"},
    "generic-prefetch-unroll1-cta-per-tile": {"CTRAINSTATE_OPT_CHAIN": "0", "CTRAINSTATE_OPT_PREFETCH": "1",
                                              "CTRAINSTATE_OPT_UNROLL": "1", "CTRAINSTATE_OPT_WAVES": "0"},
    "chain-unroll1-vstore": {"CTRAINSTATE_OPT_UNROLL": "1", "CTRAINSTATE_OPT_VSTORE": "1"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("case,setting", [
    (c, "default") for c in ["adamw_bf16", "adamw_mixed", "clip_adamw_f16", "lamb_bf16",
                             "emit_bf16", "adafactor_bf16"]] + [
    (c, s) for c in ["adamw_bf16", "clip_adamw_f16", "emit_bf16"] for s in list(_SETTINGS)[1:]])
def test_gpu_16bit_step_matches_cpu(case, setting, monkeypatch):
    """The GPU kernels (the chain kernels' and the generic kernel's 16-bit forms, each launch
    setting) give the CPU devices' bits."""
    gpus = _gpus()
    if not gpus:
        pytest.skip("no GPU devices")
    for k, v in _SETTINGS[setting].items():
        monkeypatch.setenv(k, v)

    def blocks():
        r = np.random.default_rng(9)
        if case == "adamw_bf16":
            return _adamw, [_leaf(r, 9000, BF16, BF16, [BF16, BF16]), _leaf(r, 3, BF16, BF16, [BF16, BF16], leaf=1)]
        if case == "adamw_mixed":
            return _adamw, [_leaf(r, 9001, F16, BF16, [BF16, F32]), _leaf(r, 4100, F32, F32, [BF16, F16], leaf=1)]
        if case == "clip_adamw_f16":
            return (lambda t: [(base.GLOBAL_NORM, (1.0,))] + _adamw(t)), [
                _leaf(r, 8192, F16, F16, [F16, F16], leaf=0), _leaf(r, 77, F16, F16, [F16, F32], leaf=1)]
        if case == "lamb_bf16":
            return (lambda t: [_adam(t, eps=1e-6), (base.DECAY, (0.01,)),
                               (base.TRUST_RATIO, (0.0, 1.0, 0.0)), (base.SCALE, (-1e-3,))]), [
                _leaf(r, 5000, BF16, BF16, [BF16, BF16])]
        if case == "emit_bf16":
            return _adamw, [_leaf(r, 6000, BF16, BF16, [BF16, BF16], out_dt=BF16),
                            _leaf(r, 17, BF16, F32, [F32, F32], out_dt=F32, leaf=1)]
        shape = (48, 260)
        n = shape[0] * shape[1]
        return (lambda t: [(base.FACTORED, (1.0 - t ** -0.8, 1e-30)), (base.BLOCK_RMS, (1.0,)),
                           (base.SCALE, (-1e-2,)), (base.PARAM_RMS, (1e-3,))]), [
            Block(r.standard_normal(n).astype(BF16), r.standard_normal(n).astype(BF16),
                  [np.zeros(48, BF16), np.zeros(260, BF16), np.zeros(1, BF16)], geom=(1, 0, shape, (0, 0), shape)),
            Block(r.standard_normal(700).astype(BF16), r.standard_normal(700).astype(BF16),
                  [np.zeros(1, BF16), np.zeros(1, BF16), np.zeros(700, BF16)], leaf=1)]
    make, cpu_blocks = blocks()
    _, gpu_blocks = blocks()
    for t in (1, 2, 3):
        r_cpu, cpu = _run(make(t), cpu_blocks, 2, cts.devices("cpu"), widen=False)
        r_gpu, gpu = _run(make(t), gpu_blocks, 2, gpus, widen=False)
        for i, ((wc, sc, _), (wg, sg, _)) in enumerate(zip(cpu, gpu)):
            assert_same_bits(wg, wc, True, err_msg=f"{case} step {t} block {i}")
            for q, (x, y) in enumerate(zip(sg, sc)):
                assert_same_bits(x, y, True, err_msg=f"{case} step {t} block {i} slot {q}")
        for blks, outs in ((cpu_blocks, cpu), (gpu_blocks, gpu)):
            for b, (w, s, _) in zip(blks, outs):
                if b.out_dt is None:
                    b.p = w
                b.slots = s
                b.g = (np.random.default_rng(t * 100 + b.leaf).standard_normal(b.g.shape)).astype(b.g.dtype)
        for k, (a, c) in enumerate(zip(r_gpu, r_cpu)):
            if not np.isnan(a):   # a device-resident norm is not read back (NaN)
                assert a == pytest.approx(c, rel=1e-6), (case, k)
