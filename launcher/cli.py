"""`tandem` / `python -m launcher`: run, serve, bench, and the internal worker entry.

Exit codes: 0 done; 1 the engine died (a worker crashed, a rank went silent); 2 a usage or
config error, found before any process starts wherever it can be; 128 + N stopped by signal
N (130: Ctrl-C). Errors name what the user typed: a dotted config key or a flag."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from launcher.output import LastWords, flag_message, json_error

if TYPE_CHECKING:  # the config is imported lazily: --help and --version stay fast
    from runtime.config import TandemConfig

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended
DEMO_PROMPT = "What is speculative decoding? Answer in two sentences."


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless there is nothing to show (a flag
    that takes no value; a default of None: the help says what happens then) or the help
    already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        plain_flag = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        nothing = action.default is None or action.default is argparse.SUPPRESS
        if plain_flag or nothing or "default" in text:
            return text
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed; pip install -e .)"


def _parser() -> argparse.ArgumentParser:
    """The public command line (the hidden `worker` entry has its own: _worker_parser)."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        formatter_class=_HelpFormatter,
        description="Draft-target speculative decoding across processes and GPUs.",
        epilog="Each command's options, with their defaults: "
        "tandem COMMAND --help (e.g. tandem run --help).",
    )
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,serve,bench}")
    _add_run(
        sub.add_parser(
            "run",
            help="generate once and exit",
            formatter_class=_HelpFormatter,
            description="Generate for one prompt (or a batch) and exit. The "
            "text streams to stdout; stats go to stderr. Ctrl-C "
            "stops with what was generated (exit 130).",
        )
    )
    _add_serve(
        sub.add_parser(
            "serve",
            help="serve clients until SIGINT/SIGTERM",
            formatter_class=_HelpFormatter,
            description="Start everything and serve clients at "
            "server.address until SIGINT/SIGTERM.",
        )
    )
    from launcher.bench import add_parser as add_bench_parser

    bench = add_bench_parser(sub)
    bench.formatter_class = _HelpFormatter
    _add_quiet(bench)  # its Engine's server writes plain lines anyway
    return parser


def _add_run(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "config",
        nargs="?",
        help="YAML config (default: the built-in demo, SmolLM2-135M-Instruct on "
        "the CPU as both draft and target)",
    )
    src = run.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help=f"prompt text; repeat for a batch (default for the demo: {DEMO_PROMPT!r})",
    )
    src.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="comma-separated prompt token ids, e.g. 1,2,3; repeat for a batch (no default)",
    )
    run.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens to generate at most per prompt",
    )
    run.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 is greedy",
    )
    run.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="sample from the K most likely tokens (default: no limit)",
    )
    run.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample from the most likely tokens whose probabilities sum to P (1.0: no limit)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="sampling seed; prompt i samples with S + i (default: a random one)",
    )
    run.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="stop string; repeatable (default: none)",
    )
    run.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to --prompt "
        "(default: on for the built-in demo, off otherwise)",
    )
    run.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the text as it is generated (several prompts: one after "
        "another); --no-stream prints each prompt's text once all are done",
    )
    run.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt on stdout once all are done "
        "(text, token_ids, finish_reason, stats) instead of the text",
    )
    run.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (defaults filled in) as YAML and exit",
    )
    _add_quiet(run)


def _add_listener(parser: argparse.ArgumentParser, flag: str, what: str) -> None:
    """FLAG HOST:PORT (loopback unless FLAG-allow-remote) for an endpoint serving `what`."""
    parser.add_argument(
        flag,
        metavar="HOST:PORT",
        default=None,
        help=f"also serve {what} here (loopback only unless {flag}-allow-remote; default: none)",
    )
    parser.add_argument(
        f"{flag}-allow-remote",
        action="store_true",
        help=f"allow {flag} on a non-loopback address (no authentication)",
    )


def _add_serve(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "config",
        nargs="?",
        help="YAML config (default: the built-in demo, SmolLM2-135M-Instruct on "
        "the CPU as both draft and target)",
    )
    serve.add_argument(
        "--address", help="listen here instead of server.address (default: the config's)"
    )
    _add_listener(serve, "--http", "an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model id HTTP clients name (OpenAI's `model`); requests for "
        "another get 404 (default: the target's file or directory name)",
    )
    _add_listener(serve, "--metrics", "the Prometheus metrics at GET /metrics")
    serve.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (defaults filled in) as YAML and exit",
    )
    _add_quiet(serve)


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="startup progress as plain lines (where each phase starts and "
        "ends) instead of bars; also the case when stderr is no terminal",
    )


def _worker_parser() -> argparse.ArgumentParser:
    """`tandem worker ...`: how rank 0 (or mpirun) starts a worker; not for users, so not
    in the public parser's help (argparse cannot hide a subcommand's name)."""
    worker = argparse.ArgumentParser(prog="tandem worker")
    who = worker.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int)
    who.add_argument("--rank-from-mpi", action="store_true")
    worker.add_argument("--world-size", type=int, required=True)
    worker.add_argument("--init-method", required=True)
    worker.add_argument("--startup-timeout", type=float, default=300.0)
    return worker


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"tandem: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before our own handlers were in place (imports, config checks): one line
        # from rank 0, none from a worker (rank 0 speaks for it); `run --json` still prints
        # its object (an error), which a second Ctrl-C does not cut short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if argv[:1] == ["run"] and "--json" in argv and not LastWords.wrote_any:
            json_error(lambda: "interrupted by SIGINT while starting").write()
        if argv[:1] != ["worker"]:
            print("tandem: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG", "WARNING"),
        format="[tandem] %(levelname)s %(name)s: %(message)s",
    )
    if argv[:1] == ["worker"]:
        return _worker(_worker_parser().parse_args(argv[1:]))
    args = _parser().parse_args(argv)
    if args.command == "bench":
        from launcher.bench import main as bench_main

        return bench_main(args)
    from launcher.bootstrap import control_bind
    from launcher.discovery import discover, multi_node
    from launcher.orphan import end_with_launcher
    from parallel.topology import LaunchError
    from runtime.config import ConfigError
    from runtime.control.auth import check_control_bind

    try:
        config = _load(args, check_devices=not multi_node())
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        request = _request_from_args(args, config) if args.command == "run" else None
        http, metrics = _serve_endpoints(args) if args.command == "serve" else (None, None)
        env = discover()
        check_control_bind(control_bind())  # beyond loopback only with a key, on every rank
        topology = config.topology()
        if env.world_size is not None:
            topology.check_world_size(env.world_size)
        _check_nodes(config, env)
    except ConfigError as exc:  # names its dotted key, and lists config keys as they are
        return _fail(str(exc))
    except (LaunchError, ValueError, FileNotFoundError) as exc:
        return _fail(flag_message(str(exc)) if args.command == "run" else str(exc))
    end_with_launcher(env.method, env.rank)  # torchrun's or mpirun's ranks: launcher/orphan.py
    if not env.is_orchestrator:
        from runtime.worker.process import run_worker

        # a worker rank of torchrun or mpirun: discover() read its rank, world and rendezvous
        assert env.world_size is not None and env.init_method is not None
        return run_worker(
            env.rank, env.world_size, env.init_method, config.runtime.startup_timeout_s
        )
    from launcher.session import run_once, serve_forever

    if args.command == "run":
        assert request is not None  # _request_from_args made it
        return run_once(
            config, env, request, as_json=args.json, quiet=args.quiet, stream=args.stream
        )
    return serve_forever(
        config,
        env,
        http=http,
        metrics=metrics,
        quiet=args.quiet,
        served_model_name=args.served_model_name,
        address_source="--address" if args.address else "server.address",
    )


def _check_nodes(config, env) -> None:
    """Devices that name their node against where the launcher put the ranks, on every rank
    (runtime.config.nodes); on several nodes also this node's CUDA indices, which rank 0's
    config checks cannot see."""
    from runtime.config.nodes import check_nodes

    def cuda_count() -> int:
        import torch

        return torch.cuda.device_count()

    check_nodes(config, env.layout, cuda_count if env.layout.nodes > 1 else None)


def _load(args, check_devices: bool) -> TandemConfig:
    """The config of `run`/`serve` (the built-in demo's without one), with the command
    line's overrides."""
    from runtime.config import default_config, load_config

    if args.config is None:
        config = default_config()
    else:
        config = load_config(args.config, check_devices=check_devices)
    if args.command == "serve" and args.address:
        raw = config.to_dict()  # the other server keys stay as the config says
        config = load_config(
            dict(raw, server=dict(raw["server"], address=args.address)),
            check_files=False,
            check_devices=False,
        )
    return config


def _serve_endpoints(args) -> tuple:
    """(http, metrics): the (host, port) of `serve`'s optional HTTP fronts, or None each."""
    from runtime.api.http_args import parse_http_address

    if args.served_model_name is not None:
        if not args.served_model_name.strip():
            raise ValueError("--served-model-name: expected a non-empty name")
        if args.http is None:
            raise ValueError(
                "--served-model-name: only the HTTP API names the model; give --http HOST:PORT too"
            )
    http = metrics = None
    if args.http is not None:
        http = parse_http_address(args.http, args.http_allow_remote)
    if args.metrics is not None:
        metrics = parse_http_address(
            args.metrics, args.metrics_allow_remote, flag="--metrics", what="the metrics endpoint"
        )
    return http, metrics


def _request_from_args(args, config) -> dict:
    """The run's request, checked against the config before any process starts."""
    from runtime.params import SamplingParams

    demo = args.config is None
    if args.prompt is None and args.prompt_ids is None:
        if not demo:
            raise ValueError("run: give --prompt TEXT or --prompt-ids 1,2,3")
        args.prompt = [DEMO_PROMPT]
    params = SamplingParams.from_kwargs(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or (),
    ).to_dict()
    id_lists = None
    if args.prompt_ids is not None:
        id_lists = [_parse_ids(text) for text in args.prompt_ids]
    elif not all(args.prompt):
        raise ValueError("--prompt: empty prompt")
    chat = demo if args.chat is None else args.chat
    _check_request(config, args, id_lists)
    return {
        "prompts": None if id_lists else args.prompt,
        "prompt_ids": id_lists,
        "params": params,
        "chat": chat,
        "demo": demo,
    }


def _check_request(config, args, id_lists: list[list[int]] | None) -> None:
    """What the orchestrator would refuse once everything has started, refused now, on every
    rank: text (--prompt, --stop) without a tokenizer; token ids outside the vocabulary or too
    long. (Text too long: rank 0 tokenises before any worker starts, launcher.session.)"""
    from runtime.models.loading.tokenizer import TOKENIZER_FILES, has_tokenizer_files

    path = config.tokenizer_path
    needs = "--prompt" if id_lists is None else "--stop" if args.stop else None
    if needs and not has_tokenizer_files(path):
        raise ValueError(
            f"{needs}: {path} has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); give token ids with --prompt-ids, "
            f"or name one with `tokenizer:` in the config"
        )
    if id_lists is None:
        return
    from runtime.models.loading.checkpoint import inspect_checkpoint
    from runtime.params import check_fits, check_prompt_ids

    vocab_size = inspect_checkpoint(config.target.model).vocab_size
    for i, ids in enumerate(id_lists):
        check_prompt_ids(ids, vocab_size, "--prompt-ids")
        # in the API's words, which _main's flag_message turns into --prompt-ids, --max-new-tokens
        check_fits(
            len(ids),
            args.max_new_tokens,
            config.runtime.max_seq_len,
            "prompt_token_ids",
            i if len(id_lists) > 1 else None,
        )


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids: empty prompt")
    return ids


def _worker(args) -> int:
    from launcher.orphan import end_with_launcher
    from runtime.worker.process import run_worker

    rank = args.rank
    if args.rank_from_mpi:
        from launcher.discovery import survive_mpi_fault_notice

        survive_mpi_fault_notice()
        from mpi4py import MPI

        parent = MPI.Comm.Get_parent()
        if parent != MPI.COMM_NULL:
            parent.Disconnect()
        rank = 1 + MPI.COMM_WORLD.Get_rank()
    end_with_launcher("child", rank)  # rank 0 (or the MPI daemon) started us
    return run_worker(rank, args.world_size, args.init_method, args.startup_timeout)
