"""The ``tracinfunc`` command: argument parsing only, every action is the public API.

    tracinfunc build --spec exp.py:make --out grads.zarr [--projection rademacher:512:0] ...
    tracinfunc build ... --resume          (continue an interrupted build; --overwrite: redo)
    tracinfunc score grads.zarr --spec exp.py:make --test test --top-k 10 --output top.json
    tracinfunc self-influence grads.zarr --output si.csv
    tracinfunc info grads.zarr [--verify]
    tracinfunc build ... --recorded ckpts/ --preconditioner adam       (LESS; trackstar too)
    tracinfunc select scores.npy --fraction 0.05 [--tasks tasks.json] --output chosen.json
    tracinfunc tokens grads.zarr --spec lm.py:make --top-k 10 --output tokens.json
    tracinfunc report grads.zarr --spec exp.py:make --image-shape 8x8 --output report.html

Errors print one line (``tracinfunc: error: ...``) and exit with status 1 (2 for usage
errors); ``--debug`` shows the traceback instead. ``--quiet`` and ``--debug`` go before or
after the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from tracinfunc._artifacts import check_writable
from tracinfunc._validate import calling
from tracinfunc._version import __version__
from tracinfunc.build.inputs import precision_name
from tracinfunc.build.torch import build_store
from tracinfunc.checkpoint import Checkpoint
from tracinfunc.cli.attribution import add_attribution_commands
from tracinfunc.cli.evaluate import add_evaluate_command
from tracinfunc.cli.recorded import (
    add_recorded_arguments,
    recorded_checkpoints,
    recorded_preconditioners,
)
from tracinfunc.cli.results import (
    check_output_path,
    check_result_format,
    check_writable_directory,
    write_results,
)
from tracinfunc.cli.select import add_select_command
from tracinfunc.cli.spec import Spec, SpecError, load_spec
from tracinfunc.curvature.persist import load_curvature
from tracinfunc.curvature.test_grads import preconditioned_test_grads
from tracinfunc.curvature.value import Curvature
from tracinfunc.distributed import init_from_environment
from tracinfunc.errors import (
    EmptyDataError,
    IllConditionedError,
    IncompatibleGradientsError,
    IncompleteStoreError,
    InvalidArgumentError,
    InvalidProjectionError,
    NonFiniteGradientError,
    StoreExistsError,
    StoreNotFoundError,
    TracInFuncError,
)
from tracinfunc.grads.options import GradientOptions
from tracinfunc.grads.selection import last_layers
from tracinfunc.grads.stages import Stages, model_stages
from tracinfunc.projection.spec import Projection
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.score import score
from tracinfunc.query.self_influence import self_influence
from tracinfunc.query.top_k import top_k
from tracinfunc.store.meta import StoreMeta
from tracinfunc.store.protocols import GradientStore
from tracinfunc.store.zarr.parts import StorePart, check_shard, commit_store, read_parts
from tracinfunc.store.zarr.paths import open_store, read_store_meta, remove_store, verify_store
from tracinfunc.store.zarr.urls import exists as remote_exists
from tracinfunc.store.zarr.urls import location
from tracinfunc.store.zarr.writer import ZarrWriter

__all__ = ["main"]

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
# int8 and sign are quantised storage (read back as float32), named as build_store takes them.
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int8": "int8", "sign": "sign"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "contrast_weight", None) is not None and args.contrast is None:
        parser.error("score: --contrast-weight W goes with --contrast NAME (the control set "
                     "it weighs); pass --contrast NAME or drop --contrast-weight.")
    for flag in ("refine_examples", "refine_solver", "refine_fisher", "refine_step_size",
                 "refine_batches_per_step"):
        if getattr(args, flag, None) is not None and args.refine_steps is None:
            parser.error(f"score: --{flag.replace('_', '-')} goes with --refine-steps N (it "
                         "says how the queries are refined); pass --refine-steps N or drop it.")
    if getattr(args, "refine_fisher", None) == "expected" and args.refine_solver == "direct":
        parser.error("score: --refine-fisher expected is never formed (each product is a "
                     "forward and backward pass over the data), so it has no exact solve; "
                     "use --refine-solver cg with it, or --refine-fisher sampled with "
                     "--refine-solver direct.")
    for flag in ("refine_step_size", "refine_batches_per_step"):
        if getattr(args, flag, None) is not None and args.refine_solver != "neumann":
            parser.error(f"score: --{flag.replace('_', '-')} belongs to --refine-solver neumann "
                         "(the Neumann iterations' step and sample); pass --refine-solver "
                         "neumann or drop it.")
    try:
        # Errors name the command the user typed (``tracinfunc build: ...``), also those
        # raised inside the public functions it calls.
        with calling(f"tracinfunc {args.run.__name__.lstrip('_').replace('_', '-')}"):
            return args.run(args)
    except KeyboardInterrupt:
        resume = (f"; the rows stored so far are kept: run the same command with --resume to "
                  f"continue building {str(args.out)!r}") if args.run is _build else ""
        print(f"tracinfunc: interrupted{resume}", file=sys.stderr)
        return 130
    except Exception as error:
        if args.debug:
            raise
        print(f"tracinfunc: error: {_one_line(error)}", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if isinstance(error, TracInFuncError | OSError) else (
        f"{type(error).__name__}: {text}"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracinfunc", description="TracIn training-data attribution on torch.func."
    )
    parser.add_argument("--version", action="version", version=f"tracinfunc {__version__}")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    # Also after the command. SUPPRESS: a subcommand's default must not undo the flag given
    # before it (argparse copies every value the subparser has over the main namespace).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress bars")
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    gradients = argparse.ArgumentParser(add_help=False)
    options = gradients.add_argument_group("gradient options (build, and test gradients in score)")
    options.add_argument("--chunk-size", type=_positive_int,
                         help="examples differentiated at once")
    options.add_argument("--memory-budget", type=_bytes, metavar="BYTES",
                         help="choose --chunk-size from a budget, e.g. 2GB or 512MiB")
    options.add_argument("--mixed-precision", choices=sorted(_AUTOCAST),
                         help="forward under autocast; gradients stay float32")
    options.add_argument("--checkpointing", action="store_true",
                         help="recompute activations stage by stage (Spec.stages, or the "
                              "stages of an nn.Sequential model)")
    options.add_argument("--offload", action="store_true",
                         help="with --checkpointing: stage boundaries wait in CPU memory")
    options.add_argument("--layers", nargs="+", metavar="PATTERN",
                         help="differentiate only these parameters (names or globs, e.g. "
                              "'fc2.*'); score defaults to the store's own")
    options.add_argument("--last-layers", type=_positive_int, metavar="N",
                         help="differentiate only the last N layers")
    options.add_argument("--device", type=_device, metavar="DEVICE",
                         help="where gradients (and scores) are computed, e.g. cuda, cuda:1 "
                              "or cpu; default: the checkpoints' device for gradients, CUDA "
                              "when available for scores")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = commands.add_parser("build", parents=[common, gradients],
                                help="compute a gradient store")
    build.add_argument("--spec", required=True, help="file.py:function or module:function")
    build.add_argument("--out", required=True, type=location,
                       help="directory of the Zarr store to write, e.g. grads.zarr")
    build.add_argument("--dataset-fingerprint", metavar="TEXT", default=None,
                       help="an identifier of the training data (a hash, a dataset version), "
                            "recorded in the store and compared on --resume")
    build.add_argument("--checkpoints", nargs="+", metavar="FILE[@LR]",
                       help="state-dict files (need Spec.model); default: the spec's")
    build.add_argument("--batch-size", type=_positive_int,
                       help="examples per gradient call: the spec's batches are merged or split")
    build.add_argument("--projection", default="rademacher:512:0", type=_projection,
                       help="KIND[:DIM[:SEED[:NNZ]]][,FIELD=VALUE...], e.g. sjlt:4096:0:4, "
                            "identity or kronecker:4096:0,vectors=kronecker (FIELD: split, "
                            "vectors, per_checkpoint)")
    build.add_argument("--dtype", default="float32", choices=sorted(_DTYPES),
                       help="storage: float32, float16, bfloat16, or quantised int8 (4x "
                            "smaller than float32) or sign (1 bit per value, ~30x smaller)")
    build.add_argument("--shard", type=_shard, metavar="I/N",
                       help="build only part I of N (0-based), e.g. one SLURM array task: "
                            "--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; then run "
                            "'tracinfunc commit OUT' (under torchrun: rank/world size)")
    add_recorded_arguments(build, preconditioner=True)
    existing = build.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true",
                          help="continue an interrupted build at --out")
    existing.add_argument("--overwrite", action="store_true",
                          help="replace the store at --out (deleted when the build starts)")
    build.set_defaults(run=_build)

    score = commands.add_parser("score", parents=[common, gradients],
                                help="score test examples")
    score.add_argument("store", type=location)
    score.add_argument("--spec", help="file.py:function or module:function")
    score.add_argument("--test", default="test", help="name of the spec's test set")
    score.add_argument("--checkpoints", nargs="+", metavar="FILE[@LR]",
                       help="state-dict files the store was built from (as in build)")
    add_recorded_arguments(score, preconditioner=False)
    score.add_argument("--test-store", type=location,
                       help="a store of test gradients instead of --spec/--test")
    score.add_argument("--top-k", type=_positive_int,
                       help="keep the k best training rows per test row")
    score.add_argument("--opponents", action="store_true", help="with --top-k: lowest scores")
    score.add_argument("--normalize", action="store_true", help="cosine TracIn")
    score.add_argument("--contrast", metavar="NAME",
                       help="a contrastive query: subtract the mean gradient of the spec's "
                            "test set NAME (docs/rerank.md); recorded in .json/.zarr output")
    score.add_argument("--contrast-weight", type=float, default=None, metavar="W",
                       help="with --contrast: how much of the control to subtract (1.0)")
    score.add_argument("--curvature", type=Path, metavar="PATH",
                       help="curvature-aware TracIn with a curvature saved by save_curvature")
    score.add_argument("--refine-steps", type=_positive_int, metavar="N",
                       help="with --curvature: refine each query by N conjugate-gradient steps "
                            "on the Fisher of the spec's training data")
    score.add_argument("--refine-examples", type=_positive_int, metavar="M",
                       help="with --refine-steps: use the first M training examples")
    score.add_argument("--refine-solver", choices=("cg", "direct", "neumann"), default=None,
                       help="with --refine-steps: 'cg' (default), 'direct' (the exact solve "
                            "of that Fisher, held in memory; N is then unused) or 'neumann' "
                            "(ASTRA-style preconditioned Neumann iterations)")
    score.add_argument("--refine-step-size", type=_step_size, default=None, metavar="ETA",
                       help="with --refine-solver neumann: its step size in (0, 2] (default: "
                            "chosen from the preconditioned Fisher's largest eigenvalue)")
    score.add_argument("--refine-batches-per-step", type=_positive_int, default=None,
                       metavar="B",
                       help="with --refine-solver neumann: the spec's training batches each "
                            "step's product averages over, drawn afresh (default: all)")
    score.add_argument("--refine-fisher", choices=("sampled", "expected"), default=None,
                       help="with --refine-steps: the Fisher solved, 'sampled' (default: "
                            "labels drawn from the model) or 'expected' (their expectation, "
                            "computed exactly; slower per step, with --refine-solver cg)")
    score.add_argument("--output", required=True, type=Path, help=".json, .csv, .npy or .zarr")
    score.add_argument("--overwrite", action="store_true", help="replace an existing output")
    score.set_defaults(run=_score)

    self_influence = commands.add_parser(
        "self-influence", parents=[common], help="self-influence of every training row"
    )
    self_influence.add_argument("store", type=location)
    self_influence.add_argument("--curvature", type=Path, metavar="PATH",
                                help="curvature-aware self-influence with a 'projected' "
                                     "curvature saved by save_curvature")
    self_influence.add_argument("--output", required=True, type=Path)
    self_influence.add_argument("--overwrite", action="store_true")
    self_influence.set_defaults(run=_self_influence)

    commit = commands.add_parser("commit", parents=[common],
                                 help="seal a store built in parts (build --shard I/N)")
    commit.add_argument("store", type=location)
    commit.set_defaults(run=_commit)

    info = commands.add_parser("info", parents=[common], help="describe a gradient store")
    info.add_argument("store", type=location)
    info.add_argument("--verify", action="store_true",
                      help="read every row and norm, check their checksums")
    info.set_defaults(run=_info)

    add_evaluate_command(commands, common, _positive_int)
    add_select_command(commands, common, _positive_int)
    add_attribution_commands(commands, common, _positive_int)
    return parser


def _step_size(text: str) -> float:
    """``--refine-step-size``: a finite float in ``(0, 2]``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= 2:
        raise argparse.ArgumentTypeError(
            f"expected a step size in (0, 2] (the Neumann iterations diverge beyond 2), got "
            f"{text!r}; e.g. 0.5, or leave the option out to have it chosen.")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}; leave the option out for the default."
        )
    return value


def _true_or_false(value: str) -> bool:
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")
    return value == "true"


_PROJECTION_GRAMMAR = ("KIND[:DIM[:SEED[:NNZ]]][,FIELD=VALUE...] with integers DIM, SEED, NNZ "
                       "and FIELD one of split, vectors, per_checkpoint, e.g. "
                       "kronecker:4096:0,vectors=kronecker")
# The Projection fields the positional part does not reach, with how their text is read.
_PROJECTION_FIELDS = {"split": str, "vectors": str, "per_checkpoint": _true_or_false}


def _projection(text: str) -> Projection:
    """``KIND[:DIM[:SEED[:NNZ]]][,FIELD=VALUE...]``: the positional fields, then any of
    ``split``, ``vectors`` and ``per_checkpoint`` by name
    (``kronecker:4096:0,vectors=kronecker``)."""
    head, *named = text.split(",")
    kind, *numbers = head.split(":")
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {_PROJECTION_GRAMMAR}; got {text!r}") from None
    fields: dict = dict(zip(("dim", "seed", "nnz"), values, strict=False))
    if len(values) > 3:
        raise argparse.ArgumentTypeError(
            f"expected {_PROJECTION_GRAMMAR}; got {len(values)} numbers in {head!r}")
    for item in named:
        name, equals, value = item.partition("=")
        if not equals or name not in _PROJECTION_FIELDS:
            raise argparse.ArgumentTypeError(
                f"expected {_PROJECTION_GRAMMAR}; got {item!r} in {text!r}")
        if name in fields:
            raise argparse.ArgumentTypeError(f"{name} is given twice in {text!r}")
        try:
            fields[name] = _PROJECTION_FIELDS[name](value)
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{name} {error} in {text!r}") from None
    # identity keeps every entry: a DIM given is checked against p when the layout is known
    # (it used to be ignored); other kinds default to 512.
    defaults = {} if kind == "identity" else {"dim": 512}
    try:
        return Projection(kind=kind, **{**defaults, **fields})
    except InvalidProjectionError as error:
        # The spec's own words name Python fixes (Projection(...)); what and what was got,
        # then the command line's grammar.
        said = str(error).removeprefix("Projection: ").split("; ")[0]
        raise argparse.ArgumentTypeError(
            f"{said}, in {text!r}; expected {_PROJECTION_GRAMMAR}") from None


def projection_text(projection: Projection) -> str | None:
    """The ``--projection`` text :func:`_projection` reads as ``projection`` (the fields at
    their defaults left out), or ``None`` where the grammar cannot say it (an identity
    projection without ``dim`` but with a seed, made in Python)."""
    numbers = [] if projection.dim is None else [projection.dim, projection.seed]
    if projection.kind == "sjlt" and projection.nnz != 1:
        numbers.append(projection.nnz)
    named = [f"split={projection.split}"] if projection.split != "square" else []
    named += [f"vectors={projection.vectors}"] if projection.vectors != "dense" else []
    named += ["per_checkpoint=true"] if projection.per_checkpoint else []
    text = ",".join([":".join(map(str, [projection.kind, *numbers])), *named])
    try:
        same = _projection(text) == dataclasses.replace(projection, checkpoint=None)
    except argparse.ArgumentTypeError:
        same = False
    return text if same else None


def _checkpoints(spec: Spec, files: Sequence[str] | None) -> list[Checkpoint]:
    if not files:
        if not spec.checkpoints:
            raise SpecError("build: the spec has no checkpoints; return some or pass "
                            "--checkpoints FILE[@LR] ...")
        return list(spec.checkpoints)
    if spec.model is None:
        raise SpecError("build: --checkpoints needs the spec to return its model (Spec.model).")
    return [_load_checkpoint(item, spec.model) for item in files]


def _load_checkpoint(item: str, model: torch.nn.Module) -> Checkpoint:
    """``FILE[@LR]``: the text after the last ``@`` is the lr when it is a number (so file
    names may hold ``@``); any failure to read the file is one clear line."""
    path, at, lr = item.rpartition("@")
    if not (at and _is_number(lr) and (Path(path).is_file() or not Path(item).is_file())):
        path, lr = item, "1.0"
    if not Path(path).is_file():
        raise SpecError(
            f"--checkpoints {item!r}: no file {path!r}; give FILE or FILE@LR (the text after "
            "the last @ is the learning rate, so file names may contain @)."
        )
    try:
        return Checkpoint.load(path, model, lr=float(lr), name=Path(path).stem)
    except TracInFuncError:
        raise
    except Exception as error:  # torch.load of a text file raises IndexError, EOFError, ...
        raise SpecError(
            f"--checkpoints {item!r}: {path!r} is not a state dict saved with "
            f"torch.save(model.state_dict(), path) ({type(error).__name__}: {error}); pass "
            "the checkpoint files the spec's model was trained into."
        ) from error


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _build(args: argparse.Namespace) -> int:
    sharded = args.shard is not None or init_from_environment()
    if not sharded and isinstance(args.out, Path):  # a URL: the writer refuses what it must
        _check_build_out(args.out, resume=args.resume, overwrite=args.overwrite)
    elif args.overwrite:
        raise InvalidArgumentError(
            "tracinfunc build: --overwrite cannot be used with --shard or torchrun (one part "
            "would delete the others' rows); remove the store with 'rm -r' first."
        )
    try:
        status = _build_store(args, sharded)
        if torch.distributed.is_initialized():
            # Every rank done with its collectives before gloo is torn down (a teardown
            # racing a peer's last message aborts the process).
            torch.distributed.barrier()
        return status
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _with_flag(error: IncompatibleGradientsError, sharded: bool = False
               ) -> IncompatibleGradientsError:
    """A refused resume in the command's words: the flags that give the recorded projection,
    batch size and mixed precision (only those that differ)."""
    recorded = getattr(error, "recorded_projection", None)
    if isinstance(recorded, Projection):
        text = projection_text(recorded)
        fix = (f"run the same command with --projection {text}" if text is not None else
               "this projection has no --projection form: resume it from Python with "
               "build_store(..., projection=<the projection above>)")
        start_over = ("delete the store's directory" if sharded else "pass --overwrite")
        return IncompatibleGradientsError(
            f"tracinfunc build: cannot resume the incomplete store at {error.path!r}: "
            f"{error.difference}. On the command line: {fix}, or {start_over} to start over."
        )
    record = getattr(error, "build_record", None)
    if not isinstance(record, dict):
        return error
    changed = getattr(error, "changed_keys", None)
    changed = set(record) if changed is None else set(changed)
    flags = []
    if "batch_size" in record and {"batch_size", "first_batch"} & changed:
        size = record["batch_size"]
        flags.append("without --batch-size" if size is None else f"with --batch-size {size}")
    if "mixed_precision" in record and "mixed_precision" in changed:
        names = {precision_name(dtype): flag for flag, dtype in _AUTOCAST.items()}
        recorded = record["mixed_precision"]
        flags.append("without --mixed-precision" if recorded is None
                     else f"with --mixed-precision {names.get(recorded, recorded)}")
    if not flags:
        return error
    return IncompatibleGradientsError(f"{error} On the command line: run the same command "
                                      f"{' and '.join(flags)}.")


def _build_store(args: argparse.Namespace, sharded: bool) -> int:
    spec = load_spec(args.spec)
    checkpoints = recorded_checkpoints(args, spec) or _checkpoints(spec, args.checkpoints)
    try:
        store = build_store(
            spec.loss, checkpoints, spec.train, projection=args.projection,
            dtype=_DTYPES[args.dtype], batch_size=args.batch_size,
            dataset_fingerprint=args.dataset_fingerprint,
            store=str(args.out) if sharded else _zarr_writer(args.out, replace=args.overwrite),
            progress=_progress(args), shard=args.shard, options=_gradient_options(args, spec),
            device=args.device,
            preconditioners=recorded_preconditioners(args, spec),
        )
    except IncompatibleGradientsError as error:
        raise _with_flag(error, sharded=sharded) from error
    if isinstance(store, StorePart):
        print(f"wrote part {store.index}/{store.count} (rows [{store.start}, {store.stop})) "
              f"of {args.out}; when every part is done, run 'tracinfunc commit {args.out}'")
    else:
        print(f"wrote {store}")
    return 0


def _commit(args: argparse.Namespace) -> int:
    store = commit_store(args.store)
    print(f"committed {store}")
    return 0


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cuda, cuda:1 or cpu, got {text!r}") from None


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    try:
        return check_shard((int(index), int(count)))
    except (ValueError, TracInFuncError):
        raise argparse.ArgumentTypeError(
            f"expected I/N with 0 <= I < N, e.g. 3/8, got {text!r}"
        ) from None


def _check_build_out(path: Path, *, resume: bool, overwrite: bool) -> None:
    """Fail before the spec is loaded unless --out can take the store (see docs/cli.md)."""
    caller, shown = "tracinfunc build", str(path)
    with calling(caller):
        check_writable(path, "gradient store", overwrite=overwrite)
    check_writable_directory(path.resolve().parent, what="the directory of --out")
    if not path.exists():
        return
    try:
        meta = read_store_meta(path)
    except Exception as error:
        raise StoreExistsError(
            f"{caller}: --out {shown!r} exists and is not a tracinfunc store ({error}); choose "
            "another --out (build never deletes what it did not write)."
        ) from error
    if meta.complete and resume:
        raise StoreExistsError(
            f"{caller}: {shown!r} is a finished store, there is nothing to resume; inspect it "
            f"with 'tracinfunc info {shown}', pass --overwrite to rebuild it, or choose "
            "another --out."
        )
    if meta.complete and not overwrite:
        raise StoreExistsError(
            f"{caller}: {shown!r} already holds a finished store; pass --overwrite to replace "
            f"it or choose another --out (inspect it with 'tracinfunc info {shown}')."
        )
    if not meta.complete and not (resume or overwrite):
        raise StoreExistsError(
            f"{caller}: {shown!r} holds an incomplete store ({meta.n_train} rows written) "
            "left by an interrupted build; run the same command with --resume to continue "
            "it, or pass --overwrite to start over."
        )
    if resume:
        check_writable_directory(path, what="the store")


def _zarr_writer(path: Path | str, *, replace: bool) -> Callable[[StoreMeta], ZarrWriter]:
    """``store=`` for build_store: a Zarr directory at ``path``, whatever its name (a plain
    ``"memory"`` or ``"zarr"`` would name a store kind). ``replace``: delete the store that
    :func:`_check_build_out` found there, finished or not, before writing."""
    def make(meta: StoreMeta) -> ZarrWriter:
        if replace and remote_exists(path):
            remove_store(path)
        return ZarrWriter(path, meta)

    return make


def _gradient_options(args: argparse.Namespace, spec: Spec, *,
                      default_select: Sequence[str] | None = None) -> GradientOptions:
    """The gradient options the flags ask for (``default_select`` without --layers)."""
    if args.layers and args.last_layers:
        raise SpecError("pass --layers or --last-layers, not both.")
    if args.offload and not args.checkpointing:
        raise SpecError("--offload moves checkpointed stage boundaries: add --checkpointing.")
    select = (args.layers if args.layers else
              last_layers(args.last_layers) if args.last_layers else default_select)
    return GradientOptions(
        chunk_size=args.chunk_size, memory_budget=args.memory_budget, select=select,
        mixed_precision=_AUTOCAST.get(args.mixed_precision),
        stages=_stages(spec) if args.checkpointing else None, offload=args.offload)


def _stages(spec: Spec) -> Stages:
    if spec.stages is not None:
        return spec.stages
    module, criterion = getattr(spec.loss, "module", None), getattr(spec.loss, "criterion", None)
    if module is None:
        raise SpecError(
            "--checkpointing needs stages: return Spec(stages=tif.model_stages(model, "
            "criterion, names=[...])), or build the loss with tif.loss_from_module."
        )
    return model_stages(module, criterion)


def _bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
             "mib": 2**20, "gib": 2**30}
    number = text.lower().rstrip("abgikm")
    unit = text.lower()[len(number):]
    try:
        size = int(float(number) * units[unit])
    except (ValueError, KeyError, OverflowError):  # OverflowError: "infGB"
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(
            f"expected a positive size such as 2GB, 512MiB or 1000000, got {text!r}"
        )
    return size


def _progress(args: argparse.Namespace) -> bool | None:
    return False if args.quiet else None  # None: bars on a terminal only


@contextlib.contextmanager
def _saved_curvature_fix(path: Path | None) -> Iterator[None]:
    """A damping error of the curvature saved at ``path`` (``--curvature``) also says how to
    re-damp it from the command line's side: load, re-damp and save it again."""
    try:
        yield
    except (NonFiniteGradientError, IllConditionedError) as error:
        if path is None or getattr(error, "checkpoint", None) is None:
            raise
        raise type(error)(
            f"{error} With --curvature {path}: re-damp the saved curvature and save it again, "
            f"e.g. tif.save_curvature(tif.load_curvature({str(path)!r}).with_damping(lambda), "
            f"{str(path)!r}, overwrite=True).") from None


def _score(args: argparse.Namespace) -> int:
    with _saved_curvature_fix(args.curvature):
        return _score_with(args)


def _score_with(args: argparse.Namespace) -> int:
    check_output_path(args.output, overwrite=args.overwrite)
    check_result_format(args.output, 1 if args.top_k is None else 2)
    store = open_store(str(args.store))
    curvature = None if args.curvature is None else load_curvature(args.curvature)
    curvature = _refined(args, curvature)
    test = _test_gradients(args, store, curvature)
    recorded = {}
    if args.contrast is not None:
        if args.spec is None:
            raise SpecError("score: --contrast NAME names a test set of the spec; pass --spec.")
        try:
            control = _test_gradients(args, store, curvature, name=args.contrast)
        except EmptyDataError as error:
            raise EmptyDataError(f"score: the control set {args.contrast!r} of --contrast "
                                 f"holds no examples ({error}); name a non-empty test set "
                                 "of the spec.") from None
        weight = 1.0 if args.contrast_weight is None else args.contrast_weight
        test = Contrast(test, control, weight=weight, name=args.contrast)
        recorded["contrast"] = {"control": args.contrast, "weight": test.weight,
                                "description": test.describe()}
    if args.top_k is not None:
        values, indices = top_k(store, test, k=args.top_k, largest=not args.opponents,
                                normalize=args.normalize, progress=_progress(args),
                                device=args.device, curvature=curvature)
        write_results(args.output, {"values": values, "indices": indices}, columns="top_k",
                      attributes=recorded)
    else:
        scores = score(store, test, normalize=args.normalize, progress=_progress(args),
                       device=args.device, curvature=curvature)
        write_results(args.output, {"scores": scores}, columns="matrix", attributes=recorded)
    print(f"wrote {args.output}" + (f" ({test.describe()})" if recorded else ""))
    return 0


def _refined(args: argparse.Namespace, curvature: Curvature | None) -> Curvature | None:
    """``curvature`` refined on the spec's training data when ``--refine-steps`` asks."""
    if args.refine_steps is None:  # --refine-examples/-solver/-fisher alone: refused in main
        return curvature
    if curvature is None or args.spec is None or args.test_store is not None:
        raise SpecError("score: --refine-steps needs --curvature PATH and --spec (with --test "
                        "NAME): the queries are refined on the spec's training data, so "
                        "precomputed --test-store gradients cannot be.")
    try:
        return curvature.with_refinement(load_spec(args.spec).train, steps=args.refine_steps,
                                         max_examples=args.refine_examples,
                                         solver=args.refine_solver or "cg",
                                         fisher=args.refine_fisher or "sampled",
                                         step_size=args.refine_step_size,
                                         batches_per_step=args.refine_batches_per_step)
    except InvalidArgumentError as error:
        if args.refine_batches_per_step is None or "batches_per_step=" not in str(error):
            raise
        count = re.search(r"the (\d+) batch", str(error))
        raise InvalidArgumentError(  # the flag typed, not the keyword
            f"score: --refine-batches-per-step {args.refine_batches_per_step} is more than the "
            f"{count.group(1) if count else ''} batches of the spec's training data (what "
            "each step draws from); pass fewer, or leave the option out for every batch at "
            "every step.") from error


def _test_gradients(args: argparse.Namespace, store: GradientStore,
                    curvature: Curvature | None = None, *, name: str | None = None
                    ) -> GradientStore:
    """The spec's test set ``name`` (default ``--test``) as gradients for ``store``, or
    ``--test-store``."""
    if args.test_store is not None and name is None:
        return open_store(str(args.test_store))
    if args.spec is None:
        raise SpecError("score: pass --spec (with --test NAME) or --test-store PATH.")
    spec = load_spec(args.spec)
    name = args.test if name is None else name
    if not spec.test or name not in spec.test:
        raise SpecError(f"score: the spec has no test set {name!r}; it has "
                        f"{sorted(spec.test or {})}.")
    checkpoints = recorded_checkpoints(args, spec) or _checkpoints(spec, args.checkpoints)
    # By default the store's own parameters, so the layouts match.
    options = _gradient_options(args, spec,
                                default_select=[name for name, _ in store.meta.layout])
    if curvature is not None and curvature.kind != "projected":  # preconditioned before projecting
        return preconditioned_test_grads(spec.loss, checkpoints, spec.test[name],
                                         curvature, projection=store.projection,
                                         options=options)
    return build_store(spec.loss, checkpoints, spec.test[name],
                           projection=store.projection, progress=_progress(args),
                           options=options, device=args.device)


def _self_influence(args: argparse.Namespace) -> int:
    check_output_path(args.output, overwrite=args.overwrite)
    store = open_store(str(args.store))
    curvature = None if args.curvature is None else load_curvature(args.curvature)
    with _saved_curvature_fix(args.curvature):
        values = self_influence(store, curvature=curvature)
    write_results(args.output, {"self_influence": values}, columns="vector")
    print(f"wrote {args.output}")
    return 0


def _info(args: argparse.Namespace) -> int:
    meta = read_store_meta(args.store)
    # Opening checks the arrays against the metadata; an incomplete store cannot be opened.
    store = open_store(str(args.store)) if meta.complete else None
    size = _size_on_disk(args.store)
    resume = (f"continue it with 'tracinfunc build ... --out {args.store} --resume' and the "
              "arguments it was started with")
    print(f"store       {args.store}" + ("" if size is None else
                                             f"  ({size / 2**20:.1f} MiB on disk)"))
    stored = "" if meta.quantization is None else f" (stored as {meta.quantization})"
    print(f"shape       n_ckpt={meta.n_ckpt} n_train={meta.n_train} k={meta.k} {meta.dtype}"
          f"{stored}")
    if meta.complete:
        print("complete    True")
    elif (parts := _parts_or_none(args.store)) is not None:
        done = [i for i, state in enumerate(parts) if state and state.get("complete")]
        print(f"complete    False  (sharded build: parts {done} of {len(parts)} done; run the "
              f"others with --shard I/{len(parts)}, then 'tracinfunc commit {args.store}')")
    else:
        print(f"complete    False  ({meta.n_train} rows written so far: the build was "
              f"interrupted; {resume})")
    # Names and versions are text from the store's metadata: escape what a terminal would run.
    text = projection_text(meta.projection)
    print(_escaped(f"projection  {meta.projection}"
                   + (f"  (--projection {text})" if text is not None else "")))
    print(_escaped(f"preconditioner  {meta.preconditioner or 'none'}"))
    for c in meta.checkpoints:
        print(_escaped(f"checkpoint  {c.name}  lr={c.lr:g}  fingerprint={c.fingerprint[:16]}"))
    print(f"parameters  {len(meta.layout)} tensors, p={sum(_numel(s) for _, s in meta.layout)}")
    print(_escaped(f"written by  tracinfunc {meta.library_version} "
                   f"(format {meta.format_version})"))
    if args.verify:
        if store is None:
            raise IncompleteStoreError(
                f"tracinfunc info --verify: {str(args.store)!r} is incomplete "
                f"({meta.n_train} rows written); {resume}, then verify it."
            )
        verify_store(store, progress=_progress(args))
        print("verify      every row and norm read back and matched its checksum")
    return 0


def _escaped(text: str) -> str:
    """``text`` with every non-printable character (ESC, BEL, newlines) as a Python escape."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def _parts_or_none(store: Path | str) -> list[dict | None] | None:
    """The parts of a sharded store being built, or ``None`` for a one-process store."""
    try:
        return read_parts(store)
    except StoreNotFoundError:
        return None


def _size_on_disk(store: Path | str) -> int | None:
    """Bytes of a local store's files; ``None`` for a URL (listing a bucket costs requests)."""
    if isinstance(store, str):
        return None
    return sum(f.stat().st_size for f in store.rglob("*") if f.is_file())


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


if __name__ == "__main__":
    sys.exit(main())
