"""The t5x / HF / BLOOM ported examples run end to end (reduced sizes), as a user runs them."""
import os
import subprocess
import sys

import pytest

from ctrainstate import P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(args, timeout=300):
    env = dict(os.environ)
    env.pop("CTRAINSTATE_NUM_CPU_DEVICES", None)  # each example sets its own default (8)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_t5x_partitioner_example():
    out = run(["examples/t5x_partitioner.py", "--steps", "12", "--layers", "1"])
    assert "mesh {'data': 1, 'model': 8}" in out  # t5x's CPU mesh ignores num_partitions
    assert "layers_0/wi/kernel: PartitionSpec(None, 'model')" in out
    assert "layers_0/value/kernel: PartitionSpec(None, 'model', None)" in out
    assert "token_embedder/embedding: PartitionSpec('model', None)" in out
    assert "layers_0/wi/kernel: v=None m=PartitionSpec(None, 'model')" in out
    curve = [float(v) for v in out.split("loss curve: ")[1].splitlines()[0].split()]
    assert len(curve) == 12 and curve[-1] < 0.5 * curve[0], curve
    # t5x's bfloat16 activations (float32 params and Adafactor state): it trains too, and the
    # bfloat16 rounding changes the curve (so the compute did run in bfloat16)
    out16 = run(["examples/t5x_partitioner.py", "--steps", "12", "--layers", "1",
                 "--dtype", "bfloat16"])
    assert "compute bfloat16" in out16
    assert "layers_0/wi/kernel: v=None m=PartitionSpec(None, 'model')" in out16
    curve16 = [float(v) for v in out16.split("loss curve: ")[1].splitlines()[0].split()]
    assert curve16[-1] < 0.6 * curve16[0] and curve16 != curve, (curve16, curve)


def test_hf_model_parallel_example():
    out = run(["examples/hf_model_parallel.py", "--steps", "12", "--layers", "1"])
    assert "mesh {'dp': 1, 'mp': 8}" in out
    assert ("c_fc kernel spec PartitionSpec(None, 'mp') | opt-state mu spec "
            "PartitionSpec(None, 'mp') | count None | schedule ScaleByScheduleState(count=None)") in out
    last = out.strip().splitlines()[-1]
    before, after = (float(x) for x in last.split("eval loss ")[1].split(",")[0].split(" -> "))
    assert after < before - 0.1, last
    # run_clm_mp's --dtype bfloat16: bf16 compute, float32 params and AdamW state; it trains,
    # and the losses differ from the float32 run's (the compute did round to bfloat16)
    out16 = run(["examples/hf_model_parallel.py", "--steps", "12", "--layers", "1",
                 "--dtype", "bfloat16"])
    assert "compute bfloat16" in out16
    last16 = out16.strip().splitlines()[-1]
    b16, a16 = (float(x) for x in last16.split("eval loss ")[1].split(",")[0].split(" -> "))
    assert a16 < b16 - 0.1, last16
    losses = [ln.split("loss ")[1].split()[0] for ln in out.splitlines() if ln.startswith("step ")]
    losses16 = [ln.split("loss ")[1].split()[0] for ln in out16.splitlines()
                if ln.startswith("step ")]
    assert len(losses16) == 12 and losses16 != losses


@pytest.mark.parametrize("rules", ["full", "optimus"])
def test_bloom_sharding_example(rules):
    out = run(["examples/bloom_sharding.py", "--rules", rules])
    assert "values exact: True" in out
    assert "bytes per device: min 33248, max 33248 (all params in bf16: 265984)" in out


def _bloom_specs(rules):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import bloom_sharding
    finally:
        sys.path.pop(0)
    _, spec = bloom_sharding.main(["--rules", rules])
    return spec


@pytest.mark.parametrize("rules", ["full", "optimus"])
def test_bloom_logical_specs(rules):  # reference "BLOOM logical specs (derived)"
    s = _bloom_specs(rules)
    d = "data" if rules == "full" else None
    assert s["self_attention_query_key_value"]["kernel"] == P(None, d, "model", None)
    assert s["self_attention_dense"]["kernel"] == P(None, "model", None, d)
    assert s["mlp_dense_h_to_4h"]["kernel"] == P(None, d, "model")
    assert s["mlp_dense_4h_to_h"]["kernel"] == P(None, "model", d)
    assert s["word_embeddings"]["embedding"] == P("model", d)
    assert s["ln_f"]["scale"] == P("model")
    assert s["lm_head"]["kernel"] == P(d, "model")


@pytest.mark.gpu
def test_examples_run_on_gpu():
    """On a GPU machine the default backend is the GPU: the same commands train there."""
    out = run(["examples/t5x_partitioner.py", "--steps", "6", "--layers", "1"])
    assert " on gpu;" in out
    out = run(["examples/hf_model_parallel.py", "--steps", "4", "--layers", "1"])
    assert "eval loss" in out
    out = run(["examples/bloom_sharding.py"])
    assert "values exact: True" in out


def test_hf_example_loss_is_run_clm_mp_loss():
    """examples/hf_model_parallel.py's loss_fn is run_clm_mp's: position i predicts token
    i + 1 (the last position predicts nothing), mean over the b * (l - 1) predictions of
    logsumexp(logits) - logits[next token], plus z_loss * 1e-4 * log_z**2 with log_z taken of
    the max-shifted logits; checked against that formula in float64 here, with logits large
    enough that an unshifted exp would overflow."""
    import importlib.util

    import numpy as np
    spec = importlib.util.spec_from_file_location("hf_example", os.path.join(ROOT, "examples",
                                                                             "hf_model_parallel.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass modules look themselves up there
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    rng = np.random.default_rng(0)
    b, l, v = 2, 5, 7
    logits = (rng.standard_normal((b, l, v)) * 30 + 200).astype(np.float32)
    labels = rng.integers(0, v, (b, l))
    x = logits.astype(np.float64)[:, :-1]
    m = x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x - m).sum(axis=-1))  # of the shifted logits, as run_clm_mp
    nll = log_z + m[..., 0] - np.take_along_axis(x, labels[:, 1:, None], axis=-1)[..., 0]
    for z in (0.0, 1.0):
        want = np.mean(nll + z * 1e-4 * log_z ** 2)
        got = float(np.asarray(mod.loss_fn(logits, labels, v, z_loss=z)))
        np.testing.assert_allclose(got, want, rtol=1e-5)


def _example_main(name, argv):
    """examples/<name>.py's main run in this process, its printed lines captured."""
    import contextlib
    import importlib
    import io
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        mod = importlib.import_module(name)
    finally:
        sys.path.pop(0)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        out = mod.main(argv)
    return out, buf.getvalue()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_t5x_example_jitted_and_eager_give_the_same_losses(dtype):
    """The t5x example's partitioned train step (Adafactor on the host: an op node) replays from
    C and gives the eager run's losses bit for bit."""
    from ctrainstate.t5x import partitioning as t5p
    seen = []
    real = t5p.PjitPartitioner.partition

    def spy(self, fn, *a, **k):
        p = real(self, fn, *a, **k)
        seen.append(p)
        return p
    argv = ["--steps", "3", "--layers", "1", "--dtype", dtype]
    t5p.PjitPartitioner.partition = spy
    try:
        jitted, _ = _example_main("t5x_partitioner", argv)
    finally:
        t5p.PjitPartitioner.partition = real
    eager, _ = _example_main("t5x_partitioner", argv + ["--eager"])
    assert len(jitted) == 3 and jitted == eager
    (step,) = [p for p in seen if p._fn.__name__ == "train_step"]
    (((prog, *_),),) = step._pjitted._programs._cache.values()
    assert prog.broken is None and "t5x.Adafactor.apply_gradient[op node]" in prog.as_text()
