"""tailrl command line: train | eval | generate | report | data | config | drafter | audit."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shlex
import sys
from pathlib import Path

from . import cli_audit, cli_drafter, cli_eval, cli_generate
from .config.help import groups_help
from .presets import preset_names

PRESETS = f"{', '.join(preset_names())} (tailrl/presets/; read before the YAML and the overrides)"


def cmd_train(args) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, args.preset)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .report import make_report
    from .rl.checkpoint.store import CheckpointError
    from .rl.guards import RunStalledError
    from .rl.rewards.runner import RewardError
    from .rl.run import train
    from .rl.checkpoint.run_dir import RunDirError
    from .rl.stop import Interrupted

    try:
        run_dir = train(cfg)
    except Interrupted as e:
        ckpts = Path(cfg.trainer.out_dir) / "checkpoints"
        where = f"{ckpts / e.latest}" if e.latest else "none yet (a resumed run starts fresh)"
        cmd = ["tailrl", "train", *(["--preset", args.preset] if args.preset else []),
               *([args.config] if args.config else []),
               *(o for o in args.overrides if not o.split("=")[0].strip() in ("trainer.resume", "trainer.overwrite")),
               "trainer.resume=true"]
        print(f"\nstopped by {e} after step {e.step if e.step is not None else 0}; latest checkpoint: {where}\n"
              f"resume with: {shlex.join(cmd)}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError, ImportError, RunDirError, CheckpointError, RunStalledError, RewardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "jsonl" in cfg.trainer.loggers:  # the summary and the report are made from metrics.jsonl
        from .console import eval_summary
        from .metrics import read_metrics

        if summary := eval_summary(read_metrics(run_dir)):
            print(summary)
        if cfg.trainer.report:
            print(f"report: {make_report(run_dir)} (plots: {run_dir / 'report.png'})")
        print(f"metrics: {run_dir / 'metrics.jsonl'}")
    if "tensorboard" in cfg.trainer.loggers:
        print(f"tensorboard --logdir {run_dir / 'tensorboard'}")
    return 0


def cmd_report(args) -> int:
    from .report import make_report

    try:
        print(f"report: {make_report(args.run_dir)}")
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_data(args) -> int:
    from .tasks import make_rows, write_rows

    try:
        rows = make_rows(args.task, args.n, args.seed, args.levels)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_rows(rows, args.out)
    print(f"{len(rows)} {args.task} rows -> {args.out}")
    return 0


def cmd_config_show(args) -> int:
    from .config import ConfigError, load_config
    from .config.help import show_yaml

    try:
        cfg = load_config(args.config, args.overrides, args.preset)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(show_yaml(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailrl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_generate.add_parser(sub)
    t = sub.add_parser("train", help="GRPO/DAPO training with speculative rollout (built-in default: SmolLM2 on arithmetic)",
                       epilog=groups_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.lr=1e-5 rollout.spec.mode=off")
    t.add_argument("--preset", default="", help=f"a built-in run beside the default: {PRESETS}")
    t.set_defaults(func=cmd_train)
    cli_eval.add_parser(sub)
    r = sub.add_parser("report", help="(re)build the plots and report of a run folder")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)
    d = sub.add_parser("data", help="generate datasets")
    dsub = d.add_subparsers(dest="data_command", required=True)
    mk = dsub.add_parser("make", help="write a built-in verifiable task as JSONL")
    mk.add_argument("task", help="arithmetic | countdown")
    mk.add_argument("--n", type=int, default=1000)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--levels", type=int, nargs="*", default=[], help="difficulty levels to keep (default: all)")
    mk.add_argument("--out", required=True)
    mk.set_defaults(func=cmd_data)
    c = sub.add_parser("config", help="the training config: `config show` prints it resolved, with each key's doc")
    csub = c.add_subparsers(dest="config_command", required=True)
    cs = csub.add_parser("show", help="the resolved config (defaults < YAML < overrides) as YAML with one-line docs")
    cs.add_argument("config", nargs="?", help="YAML config (optional)")
    cs.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.lr=1e-5")
    cs.add_argument("--preset", default="", help=f"a built-in run: {PRESETS}")
    cs.set_defaults(func=cmd_config_show)
    cli_drafter.add_parser(sub)
    cli_audit.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) and "=" in args.config:  # `tailrl train key=value ...` without a YAML
        args.overrides, args.config = [args.config, *args.overrides], None
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


def entry() -> None:
    """The `tailrl` command. After every atexit handler has run (Ray's shutdown, the loggers', W&B's; all are
    registered after this one, so they run first), it skips the interpreter's module teardown: extension modules
    built with nanobind (triton 3.9, which torch imports whenever it is installed, as vLLM's CPU build does) print
    'nanobind: leaked ...' reports there, after the run's last line (the summary, or the resume command)."""
    code: list[int] = []

    def exit_without_teardown() -> None:
        if code:  # an exception escaped main: Python finishes as usual, traceback and all
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code[0])

    atexit.register(exit_without_teardown)
    code.append(main() or 0)
    sys.exit(code[0])


if __name__ == "__main__":
    entry()
