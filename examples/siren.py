"""SIREN image fitting, model parallel: the Flax pjit + TrainState example ported to ctrainstate.

A SIREN (sinusoidal representation network, omega_0 = 30) maps pixel coordinates
to colours. Its kernels are declared with ``param_with_axes``; axis rules map the
hidden dimension to the ``model`` mesh axis and the batch of pixels to ``data``,
so inside ``with mesh, axis_rules(rules):`` the parameters are born sharded
(each device generates only its block) and the matrix products follow the
Megatron pattern: column-parallel layers need no communication, row-parallel
ones end in an all-reduce over ``model``. Training uses
``TrainState.create(..., tx=optim.adam(1e-4))``, ``value_and_grad`` and ``apply_gradients``
in one ``train_step`` under ``cts.jit`` (traced at the first step, then replayed from C;
``--eager`` runs it eagerly, with the same values).

    python examples/siren.py                       # 8 CPU devices, mesh data=2 x model=4
    python examples/siren.py --steps 500 --mesh 1x8 --image photo.png --out recon.png
    mpirun -n 2 python examples/siren.py --mesh 2x2 --print-losses   # 2 processes, 2 devices each

Under a launcher (``mpirun``, ``srun``) the processes join (``ctrainstate.distributed.initialize``),
the mesh spans every process's devices (each gets the mesh's size / processes CPU devices), and
process 0 prints and writes the files; the losses are the one-process run's, bit for bit.

The default image is generated (no download). The reconstruction goes to
``out/siren_reconstruction.png`` under the current directory (the folder is made if
needed; ``--out`` chooses another path). The last line printed is the PSNR.

With the ``examples`` extra installed (``pip install -e '.[examples]'``: tqdm and
matplotlib) training shows a tqdm progress bar with the loss and PSNR, and a figure
of the loss and PSNR curves beside the target and the reconstruction goes to
``out/siren_training.png`` (beside ``--out``; ``--plot`` chooses another path). Without them the script prints the loss and
PSNR every tenth of the run and writes no figure; the training and its results are
the same. ``examples/notebooks/siren.ipynb`` is this run in a notebook.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    p.add_argument("--mesh", default="2x4", help="DATAxMODEL mesh shape (default 2x4)")
    p.add_argument("--image", default=None, help="PNG (8-bit) or .npy image; default: a built-in test image")
    p.add_argument("--size", type=int, default=64, help="side of the (built-in or downsampled) image")
    p.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--layers", type=int, default=3, help="hidden sine layers (default 3)")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("out", "siren_reconstruction.png"),
                   help="where to write the reconstruction (default out/siren_reconstruction.png; "
                        "its folder is made if needed)")
    p.add_argument("--plot", default=None,
                   help="where to write the loss/PSNR curves and the images side by side when "
                        "matplotlib is installed (default: siren_training.png beside --out; "
                        "'' for none)")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--print-losses", action="store_true",
                   help="print every step's loss exactly ('loss STEP VALUE', repr of the float): "
                        "runs on other meshes or under mpirun compare bit for bit")
    p.add_argument("--eager", action="store_true",
                   help="run the training step eagerly (default: cts.jit, traced once and "
                        "replayed from C; the same values)")
    args = p.parse_args(argv)
    if args.plot is None:
        args.plot = os.path.join(os.path.dirname(args.out), "siren_training.png")
    try:
        args.data, args.model = (int(v) for v in args.mesh.lower().split("x"))
    except ValueError:
        p.error(f"--mesh must look like 2x4, got {args.mesh!r}")
    if args.data < 1 or args.model < 1:
        p.error("--mesh sizes must be >= 1")
    if args.hidden % args.model:
        p.error(f"--hidden {args.hidden} must be divisible by the model axis {args.model}")
    return args


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launcher  # noqa: E402  (reads the launcher's environment; imports no ctrainstate)

ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and "CTRAINSTATE_NUM_CPU_DEVICES" not in os.environ:
    # one process: the whole mesh; under mpirun -n N: the mesh's share of each process
    os.environ["CTRAINSTATE_NUM_CPU_DEVICES"] = str(
        launcher.devices_per_process(ARGS.data * ARGS.model, f"--mesh {ARGS.mesh}"))

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
import ctrainstate.numpy as cnp  # noqa: E402
from ctrainstate import NamedSharding, P, nn, optim, random  # noqa: E402
from ctrainstate import partitioning as nn_partitioning  # noqa: E402
from ctrainstate.train_state import TrainState  # noqa: E402

from ctrainstate.experimental import multihost_utils  # noqa: E402
from png import read_png, write_png  # noqa: E402

OMEGA_0 = 30.0
# Logical axes: the hidden units go to the 'model' mesh axis, pixels (the batch) to 'data'.
RULES = (("batch", "data"), ("hidden", "model"))


def siren_uniform(bound: float):
    """U(-bound, bound), generated in place on each device's block when sharded."""
    def init(key, shape, dtype=np.float32, out_sharding=None):
        return random.uniform(key, shape, dtype, -bound, bound, out_sharding=out_sharding)
    return init


class SineDense(nn.Module):
    """``sin(omega_0 * (x @ W + b))`` (the last layer is linear), SIREN's initialisation:
    first layer ``W ~ U(-1/fan_in, 1/fan_in)``, others ``U(-sqrt(6/fan_in)/omega_0, ...)``,
    bias ``U(-1/sqrt(fan_in), ...)``."""

    features: int
    kernel_axes: tuple
    is_first: bool = False
    is_last: bool = False
    omega_0: float = OMEGA_0

    @nn.compact
    def __call__(self, x):
        fan_in = x.shape[-1]
        bound = 1.0 / fan_in if self.is_first else math.sqrt(6.0 / fan_in) / self.omega_0
        kernel = nn_partitioning.param_with_axes(
            "kernel", siren_uniform(bound), (fan_in, self.features), axes=self.kernel_axes)
        bias = nn_partitioning.param_with_axes(
            "bias", siren_uniform(1.0 / math.sqrt(fan_in)), (self.features,),
            axes=self.kernel_axes[1:])
        y = x @ kernel + bias
        y = nn_partitioning.with_sharding_constraint(y, ("batch", self.kernel_axes[1]))
        return y if self.is_last else cnp.sin(y * self.omega_0)


class Siren(nn.Module):
    hidden: int = 256
    layers: int = 3
    out_features: int = 3

    @nn.compact
    def __call__(self, coords):
        # Alternate column- and row-parallel kernels: ('coord','hidden') splits the output
        # features over 'model' (no communication), ('hidden','feature') contracts them
        # (all-reduce over 'model'), and so on.
        x = SineDense(self.hidden, ("coord", "hidden"), is_first=True)(coords)
        sharded = True
        for _ in range(self.layers - 1):
            axes = ("hidden", "feature") if sharded else ("feature", "hidden")
            x = SineDense(self.hidden, axes)(x)
            sharded = not sharded
        last_axes = ("hidden", "rgb") if sharded else ("feature", "rgb")
        return SineDense(self.out_features, last_axes, is_last=True)(x)


def test_image(size: int) -> np.ndarray:
    """A built-in RGB test image in [0, 1]: smooth gradients, soft discs and a ring pattern."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float64) / size
    r = 0.5 + 0.35 * np.sin(2 * np.pi * (1.3 * x + 0.4 * y))
    g = 0.5 + 0.35 * np.cos(2 * np.pi * (0.8 * y - 0.6 * x) + 0.5)
    b = 0.3 + 0.5 * x * y
    for cx, cy, rad, col in ((0.3, 0.35, 0.17, (0.95, 0.2, 0.1)), (0.7, 0.65, 0.2, (0.1, 0.3, 0.9))):
        d = np.sqrt((x - cx) ** 2 + (y - cy) ** 2)
        w = 1.0 / (1.0 + np.exp((d - rad) * 60.0))
        r, g, b = (r * (1 - w) + col[0] * w, g * (1 - w) + col[1] * w, b * (1 - w) + col[2] * w)
    ring = 0.5 + 0.5 * np.cos(40.0 * np.sqrt((x - 0.5) ** 2 + (y - 0.5) ** 2))
    ring_w = np.exp(-((np.sqrt((x - 0.5) ** 2 + (y - 0.5) ** 2) - 0.45) ** 2) / 0.002)
    g = g * (1 - 0.3 * ring_w) + 0.3 * ring_w * ring
    return np.clip(np.stack([r, g, b], -1), 0.0, 1.0).astype(np.float32)


def load_image(path: str | None, size: int) -> np.ndarray:
    if path is None:
        return test_image(size)
    img = np.load(path) if path.endswith(".npy") else read_png(path)
    img = np.asarray(img, np.float32)
    if img.ndim == 2:
        img = img[:, :, None]
    if img.max() > 1.0:
        img = img / 255.0
    step = max(1, max(img.shape[0], img.shape[1]) // size)
    return img[::step, ::step]


def psnr(mse01: float) -> float:
    return float("inf") if mse01 <= 0 else 10.0 * math.log10(1.0 / mse01)


class Progress:
    """The training loop's progress: a tqdm bar with the loss and PSNR where tqdm is
    installed (on stderr; refreshed once per tenth of the run where stderr is not a
    terminal, so a log keeps ten updates), else a line every tenth of the run."""

    def __init__(self, total: int):
        self.total, self.every = total, max(1, total // 10)
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.bar = None
        else:
            quiet = {} if sys.stderr.isatty() else {"mininterval": 0, "miniters": self.every}
            self.bar = tqdm(total=total, desc="SIREN", unit="step", **quiet)

    def update(self, step: int, loss: float) -> None:
        db = psnr(loss / 4.0)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.5f}  PSNR {db:6.2f} dB", refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            print(f"step {step:5d}/{self.total}  loss {loss:.5f}  PSNR {db:6.2f} dB", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot(path: str, img: np.ndarray, recon: np.ndarray, losses) -> bool:
    """Write the loss and PSNR curves and the target beside the reconstruction to ``path``
    with matplotlib; False (nothing written) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = figure(img, recon, losses)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def figure(img: np.ndarray, recon: np.ndarray, losses):
    """A matplotlib figure: the loss (log scale) and PSNR per step, then the target and the
    reconstruction side by side. ``losses`` are the training losses on [-1, 1] targets."""
    import matplotlib.pyplot as plt
    losses = np.asarray(losses, np.float64)
    steps = np.arange(1, len(losses) + 1)
    fig, axs = plt.subplots(1, 4, figsize=(14, 3.4), width_ratios=(1.3, 1.3, 1, 1))
    axs[0].semilogy(steps, losses)
    axs[0].set(title="loss (MSE on [-1, 1])", xlabel="step")
    axs[1].plot(steps, [psnr(v / 4.0) for v in losses], color="tab:green")
    axs[1].set(title="PSNR (dB)", xlabel="step")
    for ax in axs[:2]:
        ax.grid(alpha=0.3)
    for ax, im, title in ((axs[2], img, "target"), (axs[3], recon, "reconstruction")):
        ax.imshow(np.clip(im if im.shape[-1] == 3 else im[..., 0], 0, 1),
                  cmap=None if im.shape[-1] == 3 else "gray", interpolation="nearest")
        ax.set_title(title)
        ax.axis("off")
    fig.tight_layout()
    return fig


def pick_devices(args):
    if cts.process_count() > 1:   # several processes: their CPU devices (global ids)
        if args.backend == "gpu":
            raise SystemExit("--backend gpu: GPUs across processes (NCCL) are not supported "
                             "yet; run one process, or --backend cpu")
        return cts.devices("cpu")
    if args.backend in ("auto", "gpu"):
        try:
            gpus = cts.devices("gpu")
            x = cts.device_put(np.ones(2, np.float32), gpus[0])
            cnp.sin(x)  # do the GPU kernels exist in this build?
            return gpus
        except Exception as e:  # no GPU, or the GPU backend lacks these ops
            if args.backend == "gpu":
                raise SystemExit(f"--backend gpu: {e}")
    return cts.devices("cpu")


def main(args):
    me, nproc = launcher.initialize()   # under mpirun: join the processes (global devices)
    say = print if me == 0 else (lambda *a, **k: None)   # process 0 prints and writes files
    devs = pick_devices(args)
    n = args.data * args.model
    if len(devs) < n:
        per = f"{n // nproc} per process" if nproc > 1 else f"{n}"
        raise SystemExit(f"mesh {args.data}x{args.model} needs {n} devices, {len(devs)} available "
                         f"(set CTRAINSTATE_NUM_CPU_DEVICES={per})")
    mesh = cts.Mesh(np.array(devs[:n], dtype=object).reshape(args.data, args.model), ("data", "model"))
    img = load_image(args.image, args.size)
    h, w, c = img.shape
    ys, xs = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, w), indexing="ij")
    coords = np.stack([ys, xs], -1).reshape(-1, 2).astype(np.float32)
    target = (img.reshape(-1, c) * 2.0 - 1.0).astype(np.float32)  # fit in [-1, 1]
    if coords.shape[0] % args.data:
        raise SystemExit(f"{coords.shape[0]} pixels do not split over data={args.data}")

    model = Siren(hidden=args.hidden, layers=args.layers, out_features=c)
    t0 = time.perf_counter()
    with mesh, nn_partitioning.axis_rules(RULES):
        batch = NamedSharding(mesh, P("data", None))
        coords_d = cts.device_put(coords, batch)
        target_d = cts.device_put(target, batch)
        variables = model.init(random.PRNGKey(args.seed), coords_d)  # params born sharded
        state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optim.adam(args.lr))
        axes = nn_partitioning.get_axis_names(variables["params_axes"])
        say(f"mesh {dict(mesh.shape)} on {devs[0].platform}"
            f"{f' ({nproc} processes)' if nproc > 1 else ''}; image {h}x{w}x{c}; "
              f"{sum(int(np.prod(p.shape)) for p in cts.tree_util.tree_leaves(state.params)):,} params")
        for name in sorted(state.params):
            k = state.params[name]["kernel"]
            say(f"  {name:12s} kernel {str(k.shape):12s} logical {str(axes[name]['kernel']):38s} "
                  f"-> {k.sharding.spec}")

        def train_step(state, coords, target):
            def loss_fn(params):
                pred = state.apply_fn({"params": params}, coords)
                return cnp.mean(cnp.square(pred - target))
            loss, grads = cts.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), loss

        if not args.eager:   # traced at the first step, then replayed from C (the optimizer
            train_step = cts.jit(train_step)   # step one node of the program)
        losses = []
        bar = Progress(args.steps) if me == 0 else None
        t_train = time.perf_counter()
        for step in range(1, args.steps + 1):
            state, loss_v = train_step(state, coords_d, target_d)
            losses.append(float(loss_v))   # a replicated scalar: every process holds it
            if bar is not None:
                bar.update(step, losses[-1])
            if args.print_losses:
                say(f"loss {step} {losses[-1]!r}")
        if bar is not None:
            bar.close()
        t_train = time.perf_counter() - t_train
        pred = state.apply_fn({"params": state.params}, coords_d)
        # sharded over processes: gathered whole on every process (jax's process_allgather)
        pred = multihost_utils.process_allgather(pred, tiled=True) if nproc > 1 \
            else np.asarray(pred)
    if me != 0:
        return None
    recon = np.clip((pred + 1.0) / 2.0, 0.0, 1.0).reshape(h, w, c)
    mse01 = float(np.mean((recon - img) ** 2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_png(args.out, recon if c == 3 else recon[:, :, 0])
    print(f"wrote {args.out}; {args.steps} steps in {t_train:.1f} s "
          f"({1e3 * t_train / max(args.steps, 1):.1f} ms/step), total {time.perf_counter() - t0:.1f} s")
    if args.plot:
        if plot(args.plot, img, recon, losses):
            print(f"wrote {args.plot} (loss and PSNR curves, target and reconstruction)")
        else:
            print(f"no {args.plot}: matplotlib is not installed (pip install -e '.[examples]')")
    print(f"PSNR: {psnr(mse01):.2f} dB")
    return psnr(mse01)


if __name__ == "__main__":
    main(ARGS)
