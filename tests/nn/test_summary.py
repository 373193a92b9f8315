"""``nn.tabulate`` / ``Module.tabulate``: the rows, variables and parameter counts of Flax's
summary table. Counts are derived by hand from the layer shapes; where flax is installed the
table's cells are compared with ``flax.linen``'s (its ``rich`` table read back as text)."""
import re

import numpy as np
import pytest

from ctrainstate import nn, random

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _model(m):
    class Block(m.Module):
        @m.compact
        def __call__(self, x):
            x = m.Dense(4)(x)
            x = m.BatchNorm(use_running_average=True)(x)
            return m.relu(x)

    class Foo(m.Module):
        @m.compact
        def __call__(self, x):
            h = Block(name="b0")(x)
            h = Block()(h)
            return m.Dense(2, use_bias=False)(h)
    return Foo()


def _parse(text):
    """The table as ``(rows, footer, caption)``: each row a dict column -> cell text (the
    cell's lines stripped and joined by newlines)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header = [c.strip() for c in next(ln for ln in lines if ln.startswith("┃")).strip("┃").split("┃")]
    rows, cur, body = [], [], False
    for ln in lines:
        if ln.startswith("┡"):
            body = True
            continue
        if not body:
            continue
        if ln.startswith(("├", "└")):
            if cur:
                rows.append(cur)
            cur = []
            if ln.startswith("└"):
                break
            continue
        if ln.startswith("│"):
            cur.append(ln.strip("│").split("│"))
    table = []
    for r in rows:
        cells = ["\n".join(x.strip() for x in col).strip() for col in zip(*r)]
        table.append(dict(zip(header, cells)))
    caption = next(ln.strip() for ln in lines if "Total Parameters:" in ln)
    return table[:-1], table[-1], caption


X = np.ones((16, 9), np.float32)


def _twice(m):
    class Twice(m.Module):
        def setup(self):
            self.d = m.Dense(3)

        def encode(self, x):
            return self.d(x)

        def __call__(self, x):
            return self.d(self.encode(x))
    return Twice()


def test_rows_variables_and_counts_from_the_layer_shapes():
    rows, footer, caption = _parse(_model(nn).tabulate(random.PRNGKey(0), X))
    assert [(r["path"], r["module"]) for r in rows] == [
        ("", "Foo"), ("b0", "Block"), ("b0/Dense_0", "Dense"), ("b0/BatchNorm_0", "BatchNorm"),
        ("Block_0", "Block"), ("Block_0/Dense_0", "Dense"), ("Block_0/BatchNorm_0", "BatchNorm"),
        ("Dense_0", "Dense")]
    by = {r["path"]: r for r in rows}
    assert by[""]["inputs"] == "float32[16,9]" and by[""]["outputs"] == "float32[16,2]"
    # Dense(9 -> 4): 9 * 4 + 4 = 40 float32s; BatchNorm(4): scale + bias, mean + var
    assert by["b0/Dense_0"]["params"] == "bias: float32[4]\nkernel: float32[9,4]\n\n40 (160 B)"
    assert by["b0/BatchNorm_0"]["params"].endswith("8 (32 B)")
    assert by["b0/BatchNorm_0"]["batch_stats"] == "mean: float32[4]\nvar: float32[4]\n\n8 (32 B)"
    assert by["Block_0/Dense_0"]["params"].endswith("20 (80 B)")
    assert by["Dense_0"]["params"] == "kernel: float32[4,2]\n\n8 (32 B)"
    assert by["b0"]["params"] == "" and by[""]["params"] == ""      # no variables of their own
    # 40 + 8 + 20 + 8 + 8 params, 8 + 8 batch_stats
    assert footer["outputs"] == "Total" and footer["params"] == "84 (336 B)"
    assert footer["batch_stats"] == "16 (64 B)"
    assert caption == "Total Parameters: 100 (400 B)"


def test_depth_show_repeated_methods_and_errors():
    rows, footer, caption = _parse(_model(nn).tabulate(random.PRNGKey(0), X, depth=1))
    assert [r["path"] for r in rows] == ["", "b0", "Block_0", "Dense_0"]
    by = {r["path"]: r for r in rows}
    assert by["b0"]["params"] == "48 (192 B)" and by["b0"]["batch_stats"] == "8 (32 B)"
    assert by["Block_0"]["params"] == "28 (112 B)"
    assert caption == "Total Parameters: 100 (400 B)"

    x = np.ones((2, 3), np.float32)
    rows, _, caption = _parse(_twice(nn).tabulate(random.PRNGKey(0), x))
    # a path already shown (the root's encode call, d's second call) is left out
    assert [(r["path"], r["module"]) for r in rows] == [("", "Twice"), ("d", "Dense")]
    assert caption == "Total Parameters: 12 (48 B)"
    rep, _, caption = _parse(_twice(nn).tabulate(random.PRNGKey(0), x, show_repeated=True))
    assert [(r["path"], r["module"], r["params"].split("\n")[-1]) for r in rep] == [
        ("", "Twice", ""), ("", "Twice (encode)", ""), ("d", "Dense", "12 (48 B)"),
        ("d", "Dense", "")]                              # the repeat carries no variables
    assert caption == "Total Parameters: 12 (48 B)"
    with pytest.raises(NotImplementedError, match="compute_flops"):
        nn.Dense(3).tabulate(random.PRNGKey(0), x, compute_flops=True)
    with pytest.raises(NotImplementedError, match="console_kwargs"):
        nn.Dense(3).tabulate(random.PRNGKey(0), x, console_kwargs={"width": 120})
    with pytest.raises(ValueError, match="depth must be None or an int"):
        nn.tabulate(nn.Dense(3), random.PRNGKey(0), depth=-1)(x)


def test_sizes_use_flax_units_and_partitioned_names():
    from ctrainstate._src.nn.summary import _bytes_repr
    assert [_bytes_repr(b) for b in (999, 1000, 1001, 1_500_000, 2_000_000_001)] == \
        ["999 B", "1,000 B", "1.0 KB", "1.5 MB", "2.0 GB"]
    m = nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                             ("embed", "mlp")))
    rows, _, caption = _parse(m.tabulate(random.PRNGKey(0), np.ones((2, 4), np.float32)))
    assert "kernel: float32[4,8] P(embed, mlp)" in rows[0]["params"]
    assert caption == "Total Parameters: 40 (160 B)"


def test_table_matches_live_flax():
    jax = pytest.importorskip("jax")
    fnn = pytest.importorskip("flax.linen")
    x2 = np.ones((2, 3), np.float32)
    for make, x, kw in ((_model, X, {}), (_model, X, {"depth": 1}),
                        (_twice, x2, {"show_repeated": True})):
        want = _parse(make(fnn).tabulate(jax.random.PRNGKey(0), x,
                                         console_kwargs={"width": 250}, **kw))
        got = _parse(make(nn).tabulate(random.PRNGKey(0), x, **kw))
        assert got[2] == want[2]                       # the caption's totals
        assert got[1] == want[1]                       # the footer
        assert len(got[0]) == len(want[0])
        for g, w in zip(got[0], want[0]):
            assert g == w


def test_models_with_ops_without_abstract_rules_are_tabulated():
    # the convolutions and GroupNorm have no eval_shape rule: init runs for real
    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3,))(x)
            x = nn.GroupNorm(num_groups=2)(x)
            return nn.BatchNorm(use_running_average=False)(x)
    x = np.ones((2, 6, 3), np.float32)
    rows, footer, caption = _parse(CNN().tabulate(random.PRNGKey(0), x))
    assert [r["module"] for r in rows] == ["CNN", "Conv", "GroupNorm", "BatchNorm"]
    # Conv: 3 * 3 * 4 + 4; GroupNorm and BatchNorm: 4 + 4 each; BatchNorm's mean and var
    assert rows[1]["params"].endswith("40 (160 B)")
    assert footer["params"] == "56 (224 B)" and footer["batch_stats"] == "8 (32 B)"
    assert caption == "Total Parameters: 64 (256 B)"
    # an error of the model itself still comes through
    with pytest.raises(ValueError):
        nn.Conv(4, (3,)).tabulate(random.PRNGKey(0), np.ones((3,), np.float32))
