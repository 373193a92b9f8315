"""examples/notebooks/: stored without outputs, and executed headless with the outputs a reader
should see.

The notebooks are executed with nbclient in a fresh IPython kernel (this interpreter, the
checkout's package first on its path), as CI's notebook stage does with the `notebooks` extra
(`pip install -e '.[notebooks]'`). Without nbclient, nbformat, ipykernel, ipywidgets, tqdm or
matplotlib those tests skip, so the README's test command needs none of them; with
CTRAINSTATE_REQUIRE_NOTEBOOKS=1 (CI's notebook stage) a missing one fails instead.

What is checked after a run: no cell raised (nbclient stops at the first error, and no output
is an error), nothing was written to stderr (no warning, no traceback), and each notebook's rich
outputs are there: the SIREN run's progress bar (a tqdm widget), its matplotlib figure (a PNG)
and a PSNR that shows it trained; the tour's HTML views of sharded Arrays (device tables), the
text grids of `visualize_array_sharding`, and its last check's message.
"""
import glob
import importlib
import json
import os
import re
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NB_DIR = os.path.join(ROOT, "examples", "notebooks")
NOTEBOOKS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(NB_DIR, "*.ipynb")))


def test_the_notebooks_are_there():
    assert NOTEBOOKS == ["partitioning_tour.ipynb", "siren.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs(name):
    """git holds the notebooks clean: no outputs, execution counts or widget state (an
    executed notebook committed by mistake shows up here)."""
    with open(os.path.join(NB_DIR, name)) as f:
        nb = json.load(f)
    assert nb["nbformat"] == 4
    assert "widgets" not in nb.get("metadata", {}), f"{name}: widget state stored"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, name
    for i, cell in enumerate(code):
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, (
            f"{name}: code cell {i} is stored with outputs; clear them before committing")


def _need(module):
    if os.environ.get("CTRAINSTATE_REQUIRE_NOTEBOOKS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def execute(name):
    """The notebook executed in a fresh kernel, its working directory the notebook's folder."""
    for m in ("ipykernel", "ipywidgets", "tqdm", "matplotlib"):
        _need(m)
    nbformat = _need("nbformat")
    nbclient = _need("nbclient")
    if os.environ.get("CTRAINSTATE_SANITIZED") == "1":
        pytest.skip("the kernel is a separate interpreter, not started under the sanitizers")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("MPLBACKEND", None)             # the kernel's inline backend shows the figures
    env.setdefault("OMP_WAIT_POLICY", "passive")   # a kernel beside other work (see README)
    nb = nbformat.read(os.path.join(NB_DIR, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NB_DIR}})
    t0 = time.perf_counter()
    client.execute(env=env)
    print(f"{name}: executed in {time.perf_counter() - t0:.1f} s")
    return nb


def outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def stream(nb, which="stdout"):
    return "".join(o.text for o in outputs(nb)
                   if o.output_type == "stream" and o.name == which)


def rich(nb, mime):
    return [o.data[mime] for o in outputs(nb)
            if o.output_type in ("display_data", "execute_result") and mime in o.data]


def check_clean_run(nb, name):
    errors = [o for o in outputs(nb) if o.output_type == "error"]
    assert not errors, f"{name}: {errors[0].ename}: {errors[0].evalue}"
    assert stream(nb, "stderr") == "", f"{name} wrote to stderr:\n{stream(nb, 'stderr')}"
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        assert cell.execution_count is not None, f"{name}: code cell {i} did not run"


def test_siren_notebook():
    nb = execute("siren.ipynb")
    check_clean_run(nb, "siren.ipynb")
    # the progress bar: tqdm.auto drew a widget (not text on stderr)
    assert rich(nb, "application/vnd.jupyter.widget-view+json"), "no tqdm widget"
    assert "state" in nb.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}), "widget state not kept"
    # the figure: loss and PSNR curves, target and reconstruction, one PNG
    pngs = rich(nb, "image/png")
    assert len(pngs) == 1 and len(pngs[0]) > 10_000, [len(p) for p in pngs]
    # the sharded kernel's notebook view: a device table of 4 row blocks
    html = rich(nb, "text/html")
    assert len(html) == 1 and html[0].count("<tr>") == 4 and "CPU 0,4" in html[0], html
    out = stream(nb)
    assert "SineDense_1: kernel (128, 128) sharded PartitionSpec('model', None)" in out, out
    m = re.search(r"PSNR of the reconstruction: ([\d.]+) dB", out)
    assert m and float(m.group(1)) > 45.0, out     # it trained (56.6 dB when written)


def test_partitioning_tour_notebook():
    nb = execute("partitioning_tour.ipynb")
    check_clean_run(nb, "partitioning_tour.ipynb")
    html = rich(nb, "text/html")
    # a, params['w1'] and the AdamW moment of w2: each an HTML table of its device blocks
    assert len(html) == 3 and all("<table" in h for h in html), html
    assert html[0].count("<tr>") == 2 and html[0].count("<td") == 8 and ">CPU 5<" in html[0]
    assert html[1].count("<tr>") == 1 and ">CPU 0,4<" in html[1]     # P(None, 'model')
    assert html[2].count("<tr>") == 4 and ">CPU 3,7<" in html[2]     # P('model', None)
    out = stream(nb)
    # visualize_array_sharding's text grids, one per spec
    assert "│ CPU 0,1,2,3 │" in out and "│ CPU 0,4 │ CPU 1,5 │" in out, out
    assert "│ CPU 0,1,2,3,4,5,6,7 │" in out, out
    assert "each device holds [1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024]" in out, out
    losses = [float(v) for v in re.findall(r"step \d: loss ([\d.]+)", out)]
    assert len(losses) == 5 and losses[-1] < losses[0], out
    assert out.rstrip().endswith("every parameter and AdamW moment is sharded as its logical "
                                 "axes say"), out
    specs = [o.data["text/plain"] for o in outputs(nb)
             if o.output_type == "execute_result" and "text/plain" in o.data]
    assert "PartitionSpec('data', None, 'model')" in specs and "PartitionSpec('model', None)" in specs
