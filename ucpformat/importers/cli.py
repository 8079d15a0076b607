"""``ucp convert`` and ``ucp export``: the command-line side of the importers and exporters.

::

    ucp convert SRC DST [--from FORMAT] [--allow-pickle] [--rules FILE] [--rule-param K=V]
    ucp export --to FORMAT SRC DST [--max-shard-size 5GB] [--layout training]

:func:`add_subparsers` adds both commands to an ``argparse`` sub-parser collection
(``ucpformat.cli.convert`` and ``ucpformat.cli.export`` register them in ``ucp``);
``python -m ucpformat.importers`` runs them on their own. Each
command's parser sets ``run`` (``args.run(args)`` returns the exit status: 0 done,
2 could not run). Progress bars go to stderr; ``--json`` prints the result on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from ucpformat.errors import UCPError

OK = 0
ERROR = 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    p.add_argument("--workers", type=int, default=None, help="threads (default: 2 per core)")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="tensor bytes held in memory at once (default 1GiB), e.g. 4GiB")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rule_param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _param_names(text: str) -> str | list[str]:
    """``model-order``, a comma-separated list of names, or ``@FILE`` (one name a line)."""
    if text == "model-order":
        return text
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                names = [line.strip() for line in f if line.strip()]
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no parameter names in {text!r}")
    return names


def add_subparsers(
    subparsers: Any, parent: argparse.ArgumentParser | None = None
) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """Add ``convert`` and ``export`` to ``subparsers`` (from ``add_subparsers()``)."""
    return add_convert(subparsers, parent), add_export(subparsers, parent)


def add_convert(
    subparsers: Any, parent: argparse.ArgumentParser | None = None
) -> argparse.ArgumentParser:
    """Add ``convert`` to ``subparsers``."""
    from ucpformat.importers import FORMATS as IMPORTS
    from ucpformat.layout.rules import builtin_rule_files

    parents = [parent] if parent is not None else []
    conv: argparse.ArgumentParser = subparsers.add_parser(
        "convert", parents=parents,
        help="convert another framework's checkpoint into a UCP checkpoint",
        description="Convert a checkpoint (safetensors, a Hugging Face Trainer directory, "
        "torch.save, PyTorch DCP, DeepSpeed, Megatron-LM) into a UCP checkpoint, streaming "
        "tensor by tensor.",
    )
    conv.add_argument("source", help="the checkpoint to convert (file or directory)")
    conv.add_argument("destination", help="the UCP checkpoint to write")
    conv.add_argument("--from", dest="format", choices=sorted(IMPORTS), default=None,
                      help="source format (default: detected)")
    conv.add_argument("--allow-pickle", action="store_true", default=None,
                      help="allow reading pickled metadata (PyTorch DCP's .metadata; a Hugging "
                      "Face Trainer checkpoint's optimizer.pt, scheduler.pt, rng_state*.pth, "
                      "read with torch.load(weights_only=True)): only for checkpoints you trust")
    conv.add_argument("--rules", default=None,
                      help="rule file (path, or a shipped one: "
                      f"{', '.join(builtin_rule_files())}) giving layout semantics the source "
                      "does not record")
    conv.add_argument("--rule-param", action="append", type=_rule_param, default=None,
                      metavar="KEY=VALUE", help="a rule-file parameter (repeatable)")
    conv.add_argument("--tag", default=None, help="DeepSpeed tag / Megatron iteration "
                      "(default: the latest)")
    conv.add_argument("--param-names", type=_param_names, default=None, metavar="NAMES",
                      help="torch.save training checkpoints whose optimizer numbers its "
                      "parameters: 'model-order' (the model's tensors in order, checked shape "
                      "by shape), the names in the optimizer's order separated by commas, or "
                      "@FILE with one name a line")
    conv.add_argument("--weights-only", action="store_true", default=None,
                      help="hf-trainer, safetensors: convert the weights of a training checkpoint "
                      "(Hugging Face Trainer's) alone, leaving its training state behind (the "
                      "result's notes name those files)")
    conv.add_argument("--compression", default=None, help="zstd, gzip, blosc or none")
    _common(conv)
    conv.set_defaults(run=run_convert, invalid_status=ERROR)
    return conv


def add_export(
    subparsers: Any, parent: argparse.ArgumentParser | None = None
) -> argparse.ArgumentParser:
    """Add ``export`` to ``subparsers``."""
    from ucpformat.exporters import FORMATS as EXPORTS

    parents = [parent] if parent is not None else []
    exp: argparse.ArgumentParser = subparsers.add_parser(
        "export", parents=parents,
        help="export a UCP checkpoint to another framework's format",
        description="Export a UCP checkpoint to safetensors, torch.save or DeepSpeed's "
        "universal checkpoint layout, streaming tensor by tensor.",
    )
    exp.add_argument("--to", dest="format", required=True, choices=sorted(EXPORTS),
                     help="target format")
    exp.add_argument("source", help="the UCP checkpoint")
    exp.add_argument("destination", help="file or directory to write")
    exp.add_argument("--max-shard-size", default=None, metavar="SIZE",
                     help="safetensors: shard files of at most SIZE (e.g. 5GB)")
    exp.add_argument("--layout", default=None, choices=["state_dict", "training"],
                     help="torch: a flat model state dict (default) or "
                     "{model, optimizer, ...} with a torch.optim-style optimizer state")
    exp.add_argument("--tag", default=None, help="deepspeed-universal: tag directory name")
    _common(exp)
    exp.set_defaults(run=run_export, invalid_status=ERROR)
    return exp


def _size(value: str | None) -> int | None:
    if value is None:
        return None
    from ucpformat.interchange import parse_size

    return parse_size(int(value) if value.isdigit() else value)


def _options(fn: Any, given: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The options a format's function takes; an option it does not take is an error."""
    accepted = inspect.signature(fn).parameters
    out = {}
    for key, value in given.items():
        if value is None:
            continue
        if key not in accepted:
            flag = "--" + key.replace("_", "-")
            raise UCPError(f"{flag} does not apply to format {fmt!r}")
        out[key] = value
    return out


def run_convert(args: argparse.Namespace) -> int:
    from ucpformat import importers

    fmt = args.format or importers.detect(args.source)
    given = {
        "allow_pickle": args.allow_pickle,
        "rules": args.rules,
        "rule_params": dict(args.rule_param) if args.rule_param else None,
        "tag": args.tag,
        "param_names": args.param_names,
        "weights_only": args.weights_only,
    }
    options = _options(importers.module(fmt).scan, given, fmt)
    compression = None if args.compression in (None, "none") else args.compression
    result = importers.convert(
        args.source, args.destination, format=fmt, overwrite=args.overwrite,
        workers=args.workers, memory_limit=_size(args.memory_limit),
        progress=not args.no_progress and not args.json, compression=compression, **options,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"{result.format} -> {result.destination}: {result.tensors} tensors, "
              f"{result.nbytes / 1e6:.1f} MB in {result.seconds:.1f} s")
        for note in result.notes:
            print(f"  note: {note}")
    return OK


def run_export(args: argparse.Namespace) -> int:
    from ucpformat import exporters

    given = {
        "max_shard_size": args.max_shard_size,
        "layout": args.layout,
        "tag": args.tag,
    }
    options = _options(exporters.module(args.format).export, given, args.format)
    result = exporters.export(
        args.source, args.destination, to=args.format, overwrite=args.overwrite,
        workers=args.workers, memory_limit=_size(args.memory_limit),
        progress=not args.no_progress and not args.json, **options,
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(f"{result.source} -> {result.destination} ({result.format}): {result.tensors} "
              f"tensors, {result.nbytes / 1e6:.1f} MB in {result.seconds:.1f} s")
        for note in result.notes:
            print(f"  note: {note}")
    return OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ucpformat.importers",
        description="Convert checkpoints into UCP, and export UCP checkpoints.",
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_subparsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else ERROR
    try:
        status: int = args.run(args)
        return status
    except KeyboardInterrupt:
        sys.stderr.write("ucp: interrupted\n")
        return 130
    except (UCPError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"ucp: error: {exc}\n")
        return ERROR


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
