"""The `padir` command line: thin wrappers that parse and call one library function.

Bad input (a config, a corpus, a missing artifact) ends in one line on stderr naming the
file, line or key and the cause, and exit status 2; `--debug` shows the traceback instead,
and DEBUG logs (the whole resolved config of each stage). Any other error shows its
traceback, with exit status 1. Every URL in a line or traceback is redacted (`logs.redact`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from typing import Any, BinaryIO, Literal, Sequence, TextIO

from components import artifacts, corpus, dag, datasets, logs
from components import config as config_lib
from components.errors import USER_ERRORS
from flows import local_api, stages


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set vocab.size=4000")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="padir", description=__doc__)
    parser.add_argument("--debug", action="store_true",
                        help="tracebacks instead of one-line errors, and DEBUG logs")
    commands = parser.add_subparsers(dest="command", required=True)
    stage = commands.add_parser(
        "stage", help="recompute one stage from its inputs (extra flags go to Beam)")
    stage.add_argument("name", choices=dag.STAGES)
    _add_config_args(stage)
    stage.add_argument("--cores", type=_cores, metavar="0,1",
                       help="run on these CPUs only (what `padir run --lanes` gives a stage)")
    _add_translate_command(commands)
    _add_export_command(commands)
    _add_pipeline_commands(commands)
    _add_theory_command(commands)
    return parser


# --- the whole pipeline: `padir run | status | gc | serve | report` -----------------------


def _cores(text: str) -> set[int]:
    try:
        return {int(core) for core in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of CPUs: {text!r}")


def _add_selection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_stage", metavar="STAGE",
                        help="recompute this stage and everything downstream of it")
    parser.add_argument("--only", metavar="STAGE", help="run just this stage")
    parser.add_argument("--force", action="append", default=[], metavar="STAGE",
                        help="recompute this stage (and downstream); repeatable")
    parser.add_argument("--lanes", type=int, default=1,
                        help="stages that may run at once, each in a process of its own on "
                             "its share of the CPUs (flows/lanes.py; default 1: one after "
                             "the other)")


def _add_pipeline_commands(commands) -> None:
    run = commands.add_parser(
        "run", help="run the DAG through Prefect, reusing every complete stage")
    _add_config_args(run)
    _add_selection_args(run)
    status = commands.add_parser(
        "status", help="which stages are complete, their keys and headline metrics, "
                       "and what runs that died left behind")
    _add_config_args(status)
    gc = commands.add_parser(
        "gc", help="remove what runs that died left in the workdir (temporary and partial "
                   "directories, lease files), never a complete artifact or a running stage's")
    _add_config_args(gc)
    serve = commands.add_parser(
        "serve", help="serve a scheduled Prefect deployment of the DAG (needs PREFECT_API_URL)")
    _add_config_args(serve)
    _add_selection_args(serve)
    serve.add_argument("--cron", required=True, help='schedule, e.g. "0 3 * * *"')
    serve.add_argument("--name", help="deployment name (default: the config file's name)")
    report = commands.add_parser("report", help="print the path and markdown of the report")
    _add_config_args(report)
    data = commands.add_parser("data", help="the public corpora a config reads (docs/data.md)")
    fetch = data.add_subparsers(dest="action", required=True).add_parser(
        "fetch", help="download the files a config reads under ${PADIR_DATA_ROOT}, checked "
                      "against their pinned sha256, and print their paths")
    _add_config_args(fetch)
    fetch.add_argument("--root", metavar="DIR",
                       help="local directory to fetch into, laid out like PADIR_DATA_ROOT "
                            "(default: PADIR_DATA_ROOT, else the cache ~/.cache/padir/data)")


def _run_pipeline(args: argparse.Namespace, config: config_lib.Config) -> int:
    from flows import plan

    selection = dict(from_stage=args.from_stage, only=args.only, force=args.force)
    plan.plan(config, **selection)  # a bad selection fails here, before Prefect starts
    try:
        local_api.ensure_api()
    except local_api.PrefectUnavailable as e:
        print(f"padir: error: {e}", file=sys.stderr)
        return 2
    from flows import flow

    try:
        uris = flow.padir_pipeline(args.config, args.set, lanes=args.lanes, **selection)
    except flow.StageFailed as e:
        print(f"padir: {logs.redact(str(e))}\npadir: the stages before '{e.stage}' are "
              "reused when rerun", file=sys.stderr)
        if isinstance(e.__cause__, artifacts.StageStopped):
            return 3
        return 2 if isinstance(e.__cause__, USER_ERRORS) else 1
    print(f"outputs (workdir {config.workdir}):")
    width = max(map(len, uris), default=0)
    for stage, uri in uris.items():
        print(f"  {stage:{width}} {uri}")
    report = plan.report_path(config)
    print(f"report: {report}" if report else "report: none yet (no score stage output)")
    return 0


def _print_status(args: argparse.Namespace, config: config_lib.Config) -> int:
    from flows import plan

    rows = plan.describe(config)
    width = max([len("stage"), *(len(row["stage"]) for row in rows)])
    print(f"workdir {config.workdir}")
    print(f"  {'stage':{width}} {'state':8} {'key':12} {'wall':>8}  {'next run':32} "
          "headline metrics")
    for row in rows:
        metrics = " ".join(f"{name}={value}" for name, value in row["metrics"].items())
        print(f"  {row['stage']:{width}} {row['state']:8} {row['key']:12} "
              f"{_duration(row['wall_seconds']):>8}  {row['next']:32} {metrics}".rstrip())
    walls = [row["wall_seconds"] for row in rows if row["wall_seconds"] is not None]
    print(f"  {len(walls)} of {len(rows)} stages complete, {_duration(sum(walls))} of wall time")
    found = plan.leftovers(config)
    if found:
        print(f"leftovers of runs that died ({len(found)}; `padir gc {args.config}` "
              "removes them):")
    for item in found:
        print(f"  {artifacts.join(item.stage, item.uri.rsplit('/', 1)[-1]):40} "
              f"{plan.LEFTOVER_KINDS[item.kind]}")
    return 0


def _collect_garbage(args: argparse.Namespace, config: config_lib.Config) -> int:
    from flows import plan

    garbage = plan.collect_garbage(config)
    for item in garbage.removed:
        print(f"removed {item.uri}")
    for why in garbage.in_use.values():
        print(f"kept: {why}")
    print(f"{len(garbage.removed)} leftovers removed, {len(garbage.in_use)} keys in use kept")
    return 0


def _duration(seconds: float | None) -> str:
    """1h02m, 25m03s, 7.5s; '-' for None."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{seconds:02d}s"


def _serve(args: argparse.Namespace, config: config_lib.Config) -> int:
    from flows import flow

    name = args.name or os.path.splitext(os.path.basename(args.config))[0]
    flow.serve(args.config, args.set, name=name, cron=args.cron,
                   from_stage=args.from_stage, only=args.only, force=args.force,
                   lanes=args.lanes)
    return 0


def _print_report(args: argparse.Namespace, config: config_lib.Config) -> int:
    from flows import plan

    path = plan.report_path(config)
    if path is None:
        if plan.REPORT_STAGE not in plan.dag.STAGES:
            print(f"padir: no report: this pipeline has no '{plan.REPORT_STAGE}' stage yet",
                  file=sys.stderr)
        else:
            print(f"padir: no report yet for this config: run `padir run {args.config}` "
                  f"(the '{plan.REPORT_STAGE}' stage writes {plan.REPORT_FILE})", file=sys.stderr)
        return 1
    fs, local = artifacts.filesystem(path)
    with fs.open(local, "r") as f:
        print(f"{path}\n\n{f.read()}")
    return 0


def _fetch_data(args: argparse.Namespace, config: config_lib.Config) -> int:
    root = args.root or os.environ[datasets.ROOT_VARIABLE]
    if "://" in root:
        raise datasets.FetchError(f"padir data fetch writes to a local directory, not {root}: "
                                  "give --root DIR, then copy DIR there")
    for path in datasets.fetch_all(datasets.required(config.data), root):
        print(path)
    return 0


PIPELINE_COMMANDS = {"run": _run_pipeline, "status": _print_status, "serve": _serve,
                     "report": _print_report, "gc": _collect_garbage, "data": _fetch_data}


def _reads_corpora(args: argparse.Namespace) -> bool:
    """Whether the command may run the prepare stage, the one that reads the raw corpora."""
    return args.command in ("run", "serve") or (args.command == "stage" and args.name == "prepare")


# --- `padir translate`: stdin -> stdout with a published checkpoint -------------------------


def _add_translate_command(commands) -> None:
    translate = commands.add_parser(
        "translate", help="translate stdin line by line with a training artifact (an AR "
                          "model, the student or the drafter)",
        description="Reads UTF-8 sentences from stdin, prints exactly one translation per "
                    "line. A line that is not UTF-8 gets an empty output line; it and a "
                    "source cut to the widest length bucket are reported on stderr, and the "
                    "first makes the exit status 1. Options a method does not use are an "
                    "error; unset ones take the defaults of components.config.DecodeMethod.")
    translate.add_argument("--checkpoint", required=True, metavar="DIR",
                           help="a published teacher, ar_student, student or drafter artifact, "
                                "relative or absolute, e.g. work/multi30k_en_de/student/<key>")
    translate.add_argument("--method", choices=tuple(config_lib.DECODING_KINDS),
                           help="default: refine for a student artifact, ar_beam for an AR one "
                                "(teacher, ar_student), draft_verify for a drafter one (the "
                                "teacher it started from verifies)")
    hints = typing.get_type_hints(config_lib.DecodeMethod)
    for field in config_lib.decode_options():
        _add_decode_option(translate, field, hints[field.name])
    translate.add_argument("--batch-size", type=int, default=16,
                           help="sentences decoded together (default 16)")


# The kind `padir translate` decodes an artifact with by default, by its stage (an AR one:
# ar_beam).
DEFAULT_KINDS = {"student": "refine", "drafter": "draft_verify"}

# A DecodeMethod option's flag is `--option-name`, but for these.
FLAG_NAMES = {"num_length_candidates": "--length-candidates"}


def _add_decode_option(parser: argparse.ArgumentParser, field: dataclasses.Field,
                       annotation: Any) -> None:
    """The flag of one DecodeMethod option, typed by its annotation; its help names the
    kinds that read it (`config_lib.DECODING_KINDS`), so a new option or kind needs no edit here."""
    kinds = [kind for kind, decoder in config_lib.DECODING_KINDS.items()
             if field.name in decoder.options]
    default = field.default
    if typing.get_origin(annotation) is tuple:  # tuple[int, ...]: comma-separated
        (element, _), default = typing.get_args(annotation), ",".join(map(str, default))
        options = dict(metavar="D,D,...",
                       type=lambda text: tuple(element(d) for d in text.split(",")))
    elif annotation is bool:
        options = dict(action=argparse.BooleanOptionalAction)
    elif typing.get_origin(annotation) is Literal:
        options = dict(choices=typing.get_args(annotation))
    else:
        options = dict(type=annotation)
    flag = FLAG_NAMES.get(field.name, "--" + field.name.replace("_", "-"))
    parser.add_argument(flag, dest=field.name, **options,
                        help=f"read by {', '.join(kinds)} (default {default})")


def absolute(uri: str) -> str:
    """A user-given local path made absolute (orbax refuses relative checkpoint paths)."""
    return uri if "://" in uri else os.path.abspath(uri)


def _translator(checkpoint: str, method: config_lib.DecodeMethod, batch_size: int) -> Any:
    from model import trained_model  # JAX: only for this command
    from model.decoding import translator

    return translator.Translator(trained_model.load(checkpoint), method, batch_size=batch_size)


def _translate(args: argparse.Namespace) -> int:
    checkpoint = absolute(args.checkpoint)
    stage = artifacts.read(checkpoint).stage
    kind = args.method or DEFAULT_KINDS.get(stage, "ar_beam")
    options = {field.name: getattr(args, field.name) for field in config_lib.decode_options()
               if getattr(args, field.name) is not None}
    if "model" in config_lib.DECODING_KINDS[kind].options and stage in config_lib.AR_STAGES:
        options.setdefault("model", stage)  # an AR kind decodes the AR artifact given
    method = config_lib.DecodeMethod(name=kind, kind=kind, **options)
    if method.stage != stage:  # before the checkpoint is restored
        raise config_lib.ConfigError(f"--method {kind} decodes with a {method.stage!r} "
                                     f"artifact; {args.checkpoint} is a {stage!r} one")
    if args.batch_size < 1:
        raise config_lib.ConfigError(f"--batch-size: must be >= 1, got {args.batch_size}")
    translator = _translator(checkpoint, method, args.batch_size)
    return translate_stream(translator, sys.stdin.buffer, sys.stdout, sys.stderr,
                            batch_size=args.batch_size).exit_status


# --- `padir export`: an AR model as a CTranslate2 model ---------------------------------------


def _add_export_command(commands) -> None:
    export = commands.add_parser(
        "export", help="write an AR artifact (teacher, ar_student) as a CTranslate2 model "
                       "(CPU serving)",
        description="Writes the AR model of a published teacher or ar_student artifact as a "
                    "CTranslate2 model directory (model.bin, config.json, "
                    "shared_vocabulary.json) with its SentencePiece model (spm.model); "
                    "model/decoding/ctranslate2_export.py says how the network maps. Sources are SentencePiece pieces followed by "
                    "'</s>'; decode with beam_size, max_decoding_length and "
                    "suppress_sequences as model/decoding/ctranslate2_search.py does.")
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a published teacher or ar_student artifact, e.g. "
                             "work/multi30k_en_de/teacher/<key>")
    export.add_argument("--output", required=True, metavar="DIR",
                        help="the model directory to write (replaced if it exists)")
    export.add_argument("--quantization", choices=("int8", "int16", "float16", "bfloat16"),
                        help="weights on disk (default float32; CTranslate2 can also "
                             "quantise when it loads: compute_type)")


def _export(args: argparse.Namespace) -> int:
    from model import trained_model  # JAX: only here
    from model.decoding import ctranslate2_export, ctranslate2_search

    checkpoint = absolute(args.checkpoint)
    if artifacts.read(checkpoint).stage not in config_lib.AR_STAGES:
        raise config_lib.ConfigError(f"{args.checkpoint} is not an AR artifact: only "
                                     f"{' and '.join(config_lib.AR_STAGES)} export to "
                                     "CTranslate2")
    loaded = trained_model.load(checkpoint)
    ctranslate2_export.export(loaded.model.config, loaded.params,
                              ctranslate2_search.pieces(loaded), absolute(args.output),
                              quantization=args.quantization,
                              spm_model=loaded.tokenizer.model_bytes)
    print(absolute(args.output))
    return 0


@dataclasses.dataclass
class TranslateCounts:
    """What `translate_stream` read and reported (the summary line on stderr)."""

    lines: int = 0
    not_utf8: int = 0  # given an empty output line
    truncated: int = 0  # translated from the source cut to the widest bucket

    @property
    def exit_status(self) -> int:
        return 1 if self.not_utf8 or not self.lines else 0


def translate_stream(translator: Any, stdin: BinaryIO, out: TextIO, err: TextIO, *,
                     batch_size: int) -> TranslateCounts:
    """Translates `stdin` to `out`, exactly one line per input line, `batch_size` at a time
    (a stream is translated as it arrives).

    Input is read as bytes, so that a line that is not UTF-8 costs only its own output
    line (left empty), not the lines after it. Lines are normalised as the prepare stage
    normalises sources; one that is then empty gives an empty line. Line breaks inside a
    hypothesis (byte-fallback pieces can decode to one) become spaces.
    """
    counts = TranslateCounts()
    pending: list[str | None] = []  # None: not UTF-8

    def flush() -> None:
        texts = [text for text in pending if text]
        translated = iter(translator.translate(texts) if texts else ())
        first = counts.lines - len(pending) + 1
        for number, text in enumerate(pending, first):
            if not text:
                print("", file=out)
                continue
            translation = next(translated)
            if translation.truncated:
                counts.truncated += 1
                print(f"padir translate: line {number}: the source was cut to "
                      f"{translation.source_tokens} tokens (the widest length bucket)", file=err)
            print(" ".join(translation.hypothesis.splitlines()), file=out)
        out.flush()
        pending.clear()

    for raw in stdin:
        counts.lines += 1
        try:
            pending.append(corpus.normalise(raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8")))
        except UnicodeDecodeError as e:
            counts.not_utf8 += 1
            pending.append(None)
            print(f"padir translate: line {counts.lines}: not UTF-8 ({e.reason} at byte "
                  f"{e.start}); its output line is left empty", file=err)
        if len(pending) == batch_size:
            flush()
    flush()
    if not counts.lines:
        print("padir translate: no input: stdin was empty", file=err)
    elif counts.not_utf8 or counts.truncated:
        print(f"padir translate: {counts.lines} lines, {counts.not_utf8} not UTF-8 (left "
              f"empty), {counts.truncated} cut to the widest bucket", file=err)
    return counts


# --- `padir theory`: the paper's Ising experiments (theory/experiments.py) ---------------


def _add_theory_command(commands) -> None:
    theory = commands.add_parser(
        "theory", help="measure the paper's theory on exact Ising models (PNG + JSON figures)",
        description="Parameter error of the k-pseudolikelihood against k, and steps to the "
                    "larger mode for k-Gibbs and independent parallel sampling.")
    theory.add_argument("--out", default="work/theory", metavar="DIR",
                        help="output directory (default work/theory)")
    theory.add_argument("--quick", action="store_true",
                        help="smaller runs (about 1.5 CPU-minutes instead of 4)")
    theory.add_argument("--only", choices=("masking", "sampling"),
                        help="run one experiment (default: both)")


def _theory(args: argparse.Namespace) -> int:
    from theory import experiments  # JAX and matplotlib: only for this command

    names = (args.only,) if args.only else experiments.EXPERIMENTS
    for path in experiments.run(args.out, quick=args.quick, experiments=names).values():
        print(path)
    return 0


# JAX's persistent compilation cache, unless the environment configures it: a size bound
# (least recently used programs go first) keeps it from growing without end, and programs
# that compile in a tenth of a second are kept too (JAX's default keeps those of a second
# and more: on XLA:CPU most of a decode stage's searches compile faster than that).
COMPILATION_CACHE_MAX_BYTES = 2 << 30
COMPILATION_CACHE_MIN_SECONDS = 0.1


def use_compilation_cache(environ: typing.MutableMapping[str, str] = os.environ) -> str:
    """Keeps compiled XLA programs across processes, in `$XDG_CACHE_HOME/padir/jax` (default
    ~/.cache/padir/jax) unless JAX_COMPILATION_CACHE_DIR names another directory: a stage
    run again, a resumed training or another `padir translate` loads its programs instead
    of compiling them (the demo compiles for about 4 of its 14 minutes). Takes effect only
    before JAX is imported; JAX_ENABLE_COMPILATION_CACHE=false turns it off. Returns the
    directory."""
    environ.setdefault("JAX_COMPILATION_CACHE_DIR", datasets.cache_dir(environ, "jax"))
    environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(COMPILATION_CACHE_MAX_BYTES))
    environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                       str(COMPILATION_CACHE_MIN_SECONDS))
    return environ["JAX_COMPILATION_CACHE_DIR"]


# Commands that take no config.
ARTIFACT_COMMANDS = {"translate": _translate, "theory": _theory, "export": _export}


def main(argv: Sequence[str] | None = None) -> int:
    use_compilation_cache()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    logs.configure(logging.DEBUG if args.debug else logging.INFO)
    try:
        if args.command in ARTIFACT_COMMANDS:
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            return ARTIFACT_COMMANDS[args.command](args)
        config = datasets.load_config(args.config, args.set, reads_corpora=_reads_corpora(args))
        if args.command == "stage":
            if args.cores:  # before the stage imports JAX, TensorFlow or Beam
                os.sched_setaffinity(0, args.cores)
            artifact = stages.run_stage(args.name, config, pipeline_args=extra)
            print(f"{args.name}: {artifact.uri}")
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        else:
            return PIPELINE_COMMANDS[args.command](args, config)
    except USER_ERRORS as e:
        if args.debug:
            parser.exit(2, logs.format_exception(e))
        parser.exit(2, f"padir: error: {logs.redact(str(e))}\n")
    except artifacts.StageStopped as e:  # LeaseLost too: one line, as a stop is
        parser.exit(3, f"padir: {e}\n")
    except Exception as e:  # printed here, not by Python: redacted
        parser.exit(1, logs.format_exception(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
