"""The ``shardplan`` command line: ``shardplan plan`` plans a reference model on a mesh preset;
``shardplan audit`` also compiles the planned step on fake devices and holds the prediction
against the compiled HLO; ``shardplan frontier`` plans it across hardware kinds and cluster sizes
and prints the Pareto frontier of time against cost; ``shardplan mesh list|show`` inspects presets.
Errors print one line and exit 2, no traceback; Ctrl-C exits 130 and writes nothing."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import threading

from shardplan.cli.args import fake_cpu_devices, parse_axes

# shardplan.models.layers.REMAT_POLICIES, named here so the CLI parses flags without importing jax (tests/test_cli.py)
REMAT_CHOICES = ("none", "dots", "offload", "full")


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error style: one line on stderr and exit 2, no usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# Flag types: a bad value fails while the flags are parsed, before anything is traced or solved.

def _pipeline_setting(text: str):
    if text in ("auto", "off"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pipeline setting; give auto, off or a number of "
                                         "stages, e.g. --pipeline 4")
    return value


def _int_at_least(low: int, example: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            kind = "a positive integer" if low == 1 else f"an integer of at least {low}"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; give e.g. {example}")
        return value
    return parse


def _time_limit(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number; give the limit of each ILP solve in "
                                         "CP-SAT deterministic time (about seconds of one core), e.g. --time-limit 30")
    return value


def _byte_size(text: str) -> int:
    from shardplan.util.sizes import parse_bytes
    try:
        return parse_bytes(text, what="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _output_file(text: str) -> str:
    """A path the plan can be written to (checked before planning, so that a long solve is not wasted)."""
    if not text:
        raise argparse.ArgumentTypeError("give a file path, e.g. --json plan.json")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file path, e.g. "
                                         f"{os.path.join(text, 'plan.json')}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise argparse.ArgumentTypeError(f"the folder of {text}, {folder}, {what}; create it or give another path")
    try:        # access() says yes to root in folders no one can create files in (/proc)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".shardplan-"):
            pass
    except OSError:
        raise argparse.ArgumentTypeError(f"the folder of {text}, {folder}, is not writable; give a path in a folder "
                                         "you can write to") from None
    return text


def _write_atomically(path: str, text: str) -> None:
    """Write ``path`` through ``path.tmp``: an error or Ctrl-C leaves the old file (or none) and no ``.tmp``."""
    tmp = path + ".tmp"
    created = False
    try:
        with open(tmp, "w") as f:
            created = True
            f.write(text)
        os.replace(tmp, path)
    except BaseException as e:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(f"cannot write {path}: {e.strerror or e}") from None
        raise


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C inside ends the command with KeyboardInterrupt, which main() turns into exit 130, nothing written.

    The handler records the interrupt as well as raising it, so that one swallowed on the way still
    ends the command when the block returns; on the way out the previous handler is put back. That
    also undoes CP-SAT's handling: a solve with ``catch_sigint_signal`` (CP-SAT's default) installs
    its own C-level SIGINT handler for the solve, which stops the search and returns the incumbent
    as FEASIBLE (Python never sees the signal), and resets SIGINT to SIG_DFL afterwards, so that
    the next Ctrl-C would kill the process outright. A Ctrl-C during a CP-SAT solve is only seen
    once shardplan/solve/solver.py solves with ``catch_sigint_signal = False``.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught, inside = [], threading.Event()

    def on_sigint(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    def again():
        if inside.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    def on_unraisable(unraisable):
        # Raised where Python drops exceptions (a garbage collector callback, JAX has one; a
        # weakref callback; a __del__), the interrupt is printed and lost, and the command would
        # run on to the end of the block: signal again, once out of there (while the block
        # lasts: after it, the raise below ends the command).
        if issubclass(unraisable.exc_type, KeyboardInterrupt) and inside.is_set():
            threading.Timer(0.05, again).start()
            return
        hook(unraisable)

    inside.set()
    previous, hook = signal.signal(signal.SIGINT, on_sigint), sys.unraisablehook
    sys.unraisablehook = on_unraisable
    try:
        yield
    finally:
        inside.clear()
        sys.unraisablehook = hook
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
    if caught:
        raise KeyboardInterrupt



def _cmd_plan(args) -> int:
    import shardplan
    search = args.axes == "search"
    if search and args.pipeline not in (None, "off"):
        raise ValueError("--axes search does not combine with --pipeline; choose the mesh shape first, then "
                         "plan its pipeline")
    if search and args.remat == "auto":
        raise ValueError("--axes search does not combine with --remat auto; choose the mesh shape first, then "
                         "plan its recomputation")
    mesh = shardplan.load_mesh(args.mesh, axes=None if search else parse_axes(args.axes))
    # --verify lays the plan over fake CPU devices to compile it (for any target, as audit does).
    fake_cpu_devices(mesh.num_devices if args.verify is not None else None)
    target = _installed_target("--verify", args.verify, mesh) if args.verify is not None else None
    if args.verify is not None and target is None:
        return 2
    # The planner applies the policy to every layer class, or with "auto" chooses each class's
    # with the sharding (shardplan.parallel.recompute), as remat= does in Python: the same refusals
    # (offload on a CPU mesh) and the plan says which it applied.
    step, call, jit = _step(args)
    print(f"planning {_described(args)} on {mesh.name} {dict(zip(mesh.axis_names, mesh.axis_sizes))} ...",
          file=sys.stderr, flush=True)
    with _interruptible():
        if search:
            plan, tried = shardplan.search_mesh(step, *call, hardware=mesh, memory_budget=args.memory_budget,
                                                time_limit=args.time_limit, **jit)
            for axes, step_s, secs in tried:
                shown = "infeasible" if step_s is None else f"{step_s * 1e3:.3f} ms"
                print(f"mesh shape {axes}: predicted step {shown} (planned in {secs:.1f} s)", file=sys.stderr)
        else:
            kwargs = dict(memory_budget=args.memory_budget, time_limit=args.time_limit, pipeline=args.pipeline,
                          remat=_remat_for(args.remat), context=args.context, **jit)
            if args.verify is None:
                plan = shardplan.plan(step, *call, mesh=mesh, **kwargs)
            else:
                # Planned, compiled for the target and planned again while the program is over budget.
                f = shardplan.auto(step, mesh=mesh, fit_compiled=target, **kwargs)
                plan = f.make_plan(*call)
                _say_verified(f.fit_attempts, mesh, args.memory_budget, target)
    print(plan.explain(max_activations=args.activations))
    if args.json:
        _write_atomically(args.json, plan.to_json())     # never a half-written plan on disk
        print(f"plan written to {args.json}", file=sys.stderr)
    return 0


def _tokens(text: str) -> float:
    from shardplan.util.sizes import parse_count
    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sizes(text: str) -> list[int]:
    parse = _int_at_least(1, "--devices 8,64,512")
    return [parse(part) for part in text.split(",")]


def _cmd_frontier(args) -> int:
    import shardplan
    from shardplan.devices.prices import load_prices
    hardware = [h for h in args.hardware.split(",") if h]
    prices = load_prices(args.prices)           # a bad file or an unknown name: one line, before tracing
    for h in hardware:
        prices.for_mesh(h, shardplan.load_mesh(h))
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'shardplan[bench]'") from None
    step, call, jit = _step(args)
    with _interruptible():
        result = shardplan.frontier(step, *call, hardware=hardware, devices=args.devices,
                                    tokens=args.tokens, prices=prices, memory_budget=args.memory_budget,
                                    shapes=args.shapes, pipeline=args.pipeline, remat=_remat_for(args.remat),
                                    context=args.context, time_limit=args.time_limit, **jit)
    print(result.table(every=args.all))
    if args.json:
        _write_atomically(args.json, result.to_json())
        print(f"frontier written to {args.json}", file=sys.stderr)
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _say_verified(attempts, mesh, memory_budget, target: str) -> None:
    from shardplan.util.sizes import format_bytes
    budget = memory_budget if memory_budget is not None else mesh.device.budget_bytes
    compiler = {"gpu": "the GPU compiler (deviceless)", "tpu": "the TPU compiler (deviceless)"}.get(target, "XLA CPU")
    for a in attempts:
        print(f"planned under {format_bytes(a.budget_bytes)}: predicted {format_bytes(a.predicted_bytes)}, compiled "
              f"{format_bytes(a.compiled_bytes)} per device", file=sys.stderr)
    print(f"verified on {compiler}: the compiled program needs {format_bytes(attempts[-1].compiled_bytes)} per "
          f"device, within the budget {format_bytes(budget)}"
          + (f" (planned again {len(attempts) - 1} time(s))" if len(attempts) > 1 else ""), file=sys.stderr)
    if target == "tpu":
        # The program that runs keeps libtpu's VMEM placement: its HBM is what is held to the budget.
        # `shardplan audit --target tpu` compiles with VMEM placement off (what the memory model
        # predicts), so its compiled figure is larger on small programs.
        print("(TPU: HBM of the program as it runs, VMEM placement on; the audit counts memory with it off)",
              file=sys.stderr)


def _cmd_audit(args) -> int:
    import shardplan
    mesh = shardplan.load_mesh(args.mesh, axes=parse_axes(args.axes))
    fake_cpu_devices(mesh.num_devices)      # for planning (and the cpu target's compile)
    # The GPU and TPU compilers run without a device: JAX's own backend stays on the CPU (set
    # above, before jax is imported), so that the CUDA plugin does not look for a driver.
    target = _installed_target("--target", args.target, mesh)
    if target is None:
        return 2
    step, call, jit = _step(args)
    print(f"planning and compiling {_described(args)} for {mesh.name} "
          f"{dict(zip(mesh.axis_names, mesh.axis_sizes))} on the {target} compiler ...",
          file=sys.stderr, flush=True)
    f = shardplan.auto(step, mesh=mesh, memory_budget=args.memory_budget, **jit,
                       time_limit=args.time_limit, pipeline=args.pipeline, remat=_remat_for(args.remat),
                       context=args.context)
    with _interruptible():
        f.make_plan(*call)
        if f.plan.pipeline is not None:
            print(f"pipeline: {f.plan.pipeline_config().describe()}", file=sys.stderr, flush=True)
        report = f.audit_for(target, *call)
    print(report.table())
    return 1 if report.divergences() else 0


def _installed_target(flag: str, setting: str, mesh) -> str | None:
    """The compiler ``flag`` names for ``mesh`` ("auto": the mesh's own where installed); ``None``
    after one line on stderr where it is not installed."""
    from shardplan.compiler import targets
    target = targets.resolve(setting, mesh)
    if targets.available(target):
        return target
    print(f"shardplan: error: {flag} {target}: the {target.upper()} compiler is not installed; pip install "
          f"'shardplan[aot]' (or {flag} cpu)", file=sys.stderr)
    return None


def _step(args):
    """``(step, its arguments, jax.jit options)``: the user's ``--step`` (:mod:`shardplan.tracing.named_step`),
    else ``--model``'s train step (``--scan``) on its abstract state and a ``--batch`` of abstract inputs,
    the state donated."""
    if args.step is not None:
        from shardplan.tracing.named_step import load_step
        named = load_step(args.step)
        return named.fn, named.args, named.jit
    import jax

    from shardplan.models.train import reference
    ref = reference(args.model, scan=args.scan, remat="none")
    state = jax.eval_shape(ref.init, jax.random.key(0))
    return ref.train_step, (state, ref.batch(args.batch, abstract=True)), {"donate_argnums": (0,)}


def _described(args) -> str:
    if args.step is not None:
        return f"the step of {args.step}"
    return (f"{args.model} ({'scanned' if args.scan else 'unrolled'} layers, remat {args.remat or 'default'}, "
            f"batch {args.batch})")


def _remat_for(setting: str | None):
    """``--remat`` as ``remat=``: none (or off) leaves the reference model's layers as written;
    unset, the default (searched where the step as written does not fit: shardplan.parallel.defaults)."""
    return "off" if setting in ("none", "off") else setting



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The ``shardplan`` command: :func:`main`, then out of the process. Interrupted, it leaves
    at once (``os._exit``): a solver or compiler thread still inside C++ when the interpreter
    shuts down aborts the process (exit 134, "terminate called without an active exception")
    instead of exiting 130. Output cut short by its reader (``| head``) ends it quietly."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())    # no second error at exit
        code = 0
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(130)
    sys.exit(code)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:      # the harness parses its own flags (python -m shardplan.benchmarks.bench --help)
        from shardplan.benchmarks.bench import main as bench_main
        return bench_main(argv[1:])
    parser = _Parser(prog="shardplan", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="plan a reference model's train step on a mesh preset or file")
    p.add_argument("--model", default="gpt2-small",
                   help="reference model: gpt-tiny, llama-tiny, mlp-tiny, resnet-tiny, vit-tiny, gpt2-small, "
                        "gpt3-1.3b, llama3-8b, ... (shardplan.models.train.MODEL_CONFIGS)")
    p.add_argument("--step", default=None, metavar="FILE.py:FUNC",
                   help="your own step instead of --model: FUNC() returns (step, args) or (step, args, "
                        "{'donate_argnums': ...}), args abstract or real (docs/cli.md)")
    p.add_argument("--mesh", default="h100-8", help="preset name or mesh file path")
    p.add_argument("--axes", default=None, help="override the logical mesh axes, e.g. data=2,model=4; "
                                                "'search' tries every data x model shape and keeps the best")
    p.add_argument("--batch", type=_int_at_least(1, "--batch 16"), default=16, help="global batch size")
    p.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True, help="scan over layers")
    p.add_argument("--remat", default=None, choices=REMAT_CHOICES + ("auto", "off"),
                   help="activation recomputation per layer: none or off (as written), dots (keep matmul results), "
                        "full (keep layer inputs), or auto (each layer class's policy chosen with the sharding: the "
                        "fastest plan that fits the budget); default: as written, auto where that does not fit")
    p.add_argument("--pipeline", type=_pipeline_setting, default=None,
                   help="pipeline stages: auto (plan each candidate pipeline, keep the best), off, or a number "
                        "of stages (default: auto on a mesh of several nodes, and where the step as written does "
                        "not fit the budget; else off)")
    p.add_argument("--context", choices=("auto", "off"), default=None,
                   help="attention split over the sequence (models written with shardplan.attention, e.g. "
                        "llama3-8b-128k): auto plans it unsplit and each way to split it, and keeps the best; "
                        "default: unsplit, auto where that does not fit")
    p.add_argument("--memory-budget", type=_byte_size, default=None,
                   help="per-device budget, e.g. 60GiB or 6e10 (default: what the allocator hands out on the "
                        "device, meshes/README.md)")
    p.add_argument("--time-limit", type=_time_limit, default=30.0,
                   help="ILP limit in CP-SAT deterministic time (about seconds of one core)")
    p.add_argument("--activations", type=_int_at_least(0, "--activations 20"), default=20,
                   help="activation rows to print")
    p.add_argument("--json", type=_output_file, default=None,
                   help="also write the plan as JSON to this path (its folder must exist and be writable)")
    p.add_argument("--verify", nargs="?", const="auto", default=None, choices=("auto", "cpu", "gpu", "tpu"),
                   help="compile the plan for the mesh's real compiler (auto: the preset's GPU or TPU compiler "
                        "where installed, else cpu) and plan again under a tighter budget while the compiled "
                        "program exceeds the budget")
    a = sub.add_parser("audit", help="plan, compile on fake devices, and hold the prediction against the compiled "
                                     "HLO (exit 1 when a figure diverges)")
    for flag in ("--model", "--step", "--mesh", "--axes", "--batch", "--scan", "--remat", "--context",
                 "--memory-budget", "--time-limit"):
        action = next(x for x in p._actions if flag in x.option_strings)
        kwargs = dict(default=action.default, help=action.help, choices=action.choices)
        if isinstance(action, argparse.BooleanOptionalAction):
            a.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            a.add_argument(flag, type=action.type, **kwargs)
    a.add_argument("--pipeline", type=_pipeline_setting, default=None,
                   help="pipeline stages: auto (plan each candidate pipeline, audit the best), off, or a number of "
                        "stages (default, as for plan: auto on a mesh of several nodes, and where the step as written "
                        "does not fit; else off)")
    a.add_argument("--target", default="auto", choices=("auto", "cpu", "gpu", "tpu"),
                   help="the compiler: gpu / tpu compile for the preset's device with none present (pip install "
                        "'shardplan[aot]'); cpu on fake CPU devices; auto: the preset's own where installed, else cpu")
    f = sub.add_parser("frontier", help="plan a reference model on hardware kinds x cluster sizes: the Pareto "
                                         "frontier of time to train against cost")
    f.add_argument("--model", default="gpt2-small", help=p._option_string_actions["--model"].help)
    f.add_argument("--step", default=None, metavar="FILE.py:FUNC", help=p._option_string_actions["--step"].help)
    f.add_argument("--hardware", default="a100-8,h100-8,h200-8,tpu-v5e-256,tpu-v5p-64",
                   help="comma-separated presets or mesh files (their device, links and devices per node)")
    f.add_argument("--devices", type=_sizes, default=[8, 64, 256, 1024],
                   help="comma-separated cluster sizes in devices, each whole nodes (e.g. 8,64,512,4096)")
    f.add_argument("--tokens", type=_tokens, required=True, help="tokens to train, e.g. 300e9 or 300B")
    f.add_argument("--prices", required=True,
                   help="prices file: per-device-hour price of each hardware, with its source and date "
                        "(meshes/prices/example.toml shows the format; no price is built in)")
    f.add_argument("--batch", type=_int_at_least(1, "--batch 1536"), default=16, help="global batch size")
    f.add_argument("--scan", action=argparse.BooleanOptionalAction, default=True, help="scan over layers")
    f.add_argument("--shapes", choices=("preset", "search"), default="preset",
                   help="mesh shapes: preset (the preset's model axis, the data axis grown) or search (also every "
                        "power-of-two model axis within a node)")
    for flag in ("--remat", "--pipeline", "--context", "--memory-budget"):    # as plan's; a pinned family plans faster
        action = p._option_string_actions[flag]
        f.add_argument(flag, type=action.type, choices=action.choices, default=None, help=action.help)
    f.add_argument("--time-limit", type=_time_limit, default=30.0,
                   help=p._option_string_actions["--time-limit"].help)
    f.add_argument("--all", action="store_true", help="list every planned size, not only the frontier")
    f.add_argument("--json", type=_output_file, default=None, help="also write every point as JSON to this path")
    f.add_argument("--plot", type=_output_file, default=None,
                   help="also plot time against cost to this PNG path (matplotlib: the bench extra)")
    sub.add_parser("bench", help="the benchmark harness: planner vs hand plans over models, meshes and budgets "
                                 "(shardplan bench --help)")
    m = sub.add_parser("mesh", help="list, show, validate, create and calibrate mesh files and presets")
    msub = m.add_subparsers(dest="mesh_cmd", required=True)
    msub.add_parser("list", help="list the presets")
    show = msub.add_parser("show", help="print a preset or file with derived figures")
    show.add_argument("name")
    val = msub.add_parser("validate", help="check a mesh file (one line per problem, exit 2 when bad)")
    val.add_argument("path")
    new = msub.add_parser("new", help="write a mesh file from MaxText-style flags: --ici-AXIS N --dcn-AXIS N "
                                      "(one -1 per kind is filled in from the device count)")
    new.add_argument("--hardware", default="h100-8", help="preset whose device and links to use")
    new.add_argument("--name", default="custom", help="name of the new mesh")
    new.add_argument("--nodes", type=_int_at_least(1, "--nodes 2"), default=None,
                     help="number of nodes (default: the preset's)")
    new.add_argument("--devices-per-node", type=_int_at_least(1, "--devices-per-node 8"), default=None,
                     help="default: the preset's")
    new.add_argument("--out", required=True, help="path of the mesh file to write")
    cal = msub.add_parser("calibrate", help="measure jax.devices() (matmul, memory, all-reduce per mesh axis) "
                                            "and write a mesh file the planner uses")
    cal.add_argument("--out", required=True, help="path of the mesh file to write")
    cal.add_argument("--base", default="cpu-8", help="preset for what is not measured (memory size, topology)")
    cal.add_argument("--axes", default=None, help="mesh axes to measure, e.g. data=2,model=4 (default: the base's)")
    cal.add_argument("--name", default=None, help="name of the calibrated mesh")
    cal.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (seconds, noisier)")
    cal.add_argument("--cpu-devices", type=_int_at_least(1, "--cpu-devices 8"), default=8,
                     help="fake CPU devices when XLA_FLAGS sets none")
    cal.add_argument("--coordinator", default=None,
                     help="multi-host: HOST:PORT of process 0 (jax.distributed); run the same command on every host")
    cal.add_argument("--num-processes", type=_int_at_least(1, "--num-processes 2"), default=None,
                     help="multi-host: how many processes")
    cal.add_argument("--process-id", type=_int_at_least(0, "--process-id 0"), default=None,
                     help="multi-host: this process's index (0 writes the file)")
    args, extra = parser.parse_known_args(argv)
    if extra and not (args.cmd == "mesh" and args.mesh_cmd == "new"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from shardplan.errors import ShardplanError
    try:
        if args.cmd == "mesh":
            from shardplan.cli.mesh import command
            return command(args, extra)
        return {"plan": _cmd_plan, "audit": _cmd_audit, "frontier": _cmd_frontier}[args.cmd](args)
    except BrokenPipeError:
        raise                   # its reader has gone (| head): run() ends quietly
    except (ShardplanError, ValueError, KeyError, OSError) as e:
        text = e.args[0] if isinstance(e, KeyError) and e.args else e     # a KeyError's str() is quoted
        print(f"shardplan: error: {text}", file=sys.stderr)
        return 2
    except Exception as e:      # noqa: BLE001 - XLA refusing a program: one line, no traceback
        if type(e).__name__ != "JaxRuntimeError":
            raise
        print(f"shardplan: error: the compiler refused the program: {str(e).splitlines()[0][:400]}", file=sys.stderr)
        return 1
