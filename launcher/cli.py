"""`tandem` / `python -m launcher`: run, serve, and the internal worker entry."""
from __future__ import annotations

import argparse
import logging
import os
import sys

EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Draft-target speculative "
                                     "decoding across processes and GPUs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate once and exit")
    run.add_argument("config", nargs="?", help="YAML config (default: built-in SmolLM2 demo)")
    src = run.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append",
                     help="prompt text (repeat for a batch; --json then prints one line each)")
    src.add_argument("--prompt-ids", action="append",
                     help="comma-separated prompt token ids, e.g. 1,2,3 (repeatable)")
    run.add_argument("--max-new-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    run.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the tokenizer's chat template to --prompt "
                          "(default: on for the built-in demo, off otherwise)")
    run.add_argument("--json", action="store_true", help="print one JSON object")
    _add_quiet(run)
    serve = sub.add_parser("serve", help="serve clients until SIGINT/SIGTERM")
    serve.add_argument("config")
    serve.add_argument("--address", help="override server.address")
    _add_quiet(serve)
    serve.add_argument("--http", metavar="HOST:PORT", default=None,
                       help="also serve an OpenAI-compatible HTTP API here "
                            "(loopback only unless --http-allow-remote)")
    serve.add_argument("--http-allow-remote", action="store_true",
                       help="allow --http on a non-loopback address (no authentication)")
    serve.add_argument("--metrics", metavar="HOST:PORT", default=None,
                       help="also serve the Prometheus metrics at GET /metrics here "
                            "(loopback only unless --metrics-allow-remote)")
    serve.add_argument("--metrics-allow-remote", action="store_true",
                       help="allow --metrics on a non-loopback address (no authentication)")
    from launcher.bench import add_parser as add_bench_parser

    _add_quiet(add_bench_parser(sub))   # its Engine's server writes plain lines anyway
    worker = sub.add_parser("worker", help=argparse.SUPPRESS)
    who = worker.add_mutually_exclusive_group(required=True)
    who.add_argument("--rank", type=int)
    who.add_argument("--rank-from-mpi", action="store_true")
    worker.add_argument("--world-size", type=int, required=True)
    worker.add_argument("--init-method", required=True)
    worker.add_argument("--startup-timeout", type=float, default=300.0)
    return parser


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", action="store_true",
                        help="startup progress as plain lines (where each phase starts and "
                             "ends) instead of bars; also the case when stderr is no terminal")


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"tandem: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("TANDEM_LOG", "WARNING"),
                        format="[tandem] %(levelname)s %(name)s: %(message)s")
    if args.command == "worker":
        return _worker(args)
    if args.command == "bench":
        from launcher.bench import main as bench_main

        return bench_main(args)
    from launcher.bootstrap import control_bind
    from launcher.discovery import discover
    from runtime.control.auth import check_control_bind
    from parallel.topology import LaunchError, topology_from_config
    from runtime.config import ConfigError, default_config, load_config

    try:
        config_path = getattr(args, "config", None)
        from launcher.discovery import multi_node

        config = load_config(config_path, check_devices=not multi_node()) if config_path \
            else default_config()
        if args.command == "serve" and args.address:
            config = load_config(dict(config.to_dict(), server={"address": args.address}),
                                 check_files=False, check_devices=False)
        request = _request_from_args(args, config_path is None) if args.command == "run" \
            else None
        http = metrics = None
        if args.command == "serve" and (args.http is not None or args.metrics is not None):
            from runtime.api.http_args import parse_http_address

            if args.http is not None:
                http = parse_http_address(args.http, args.http_allow_remote)
            if args.metrics is not None:
                metrics = parse_http_address(args.metrics, args.metrics_allow_remote,
                                             flag="--metrics", what="the metrics endpoint")
        env = discover()
        check_control_bind(control_bind())   # beyond loopback only with a key, on every rank
        topology = topology_from_config(config)
        if env.world_size is not None:
            topology.check_world_size(env.world_size)
    except (ConfigError, LaunchError, ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    if not env.is_orchestrator:
        from runtime.worker.process import run_worker

        return run_worker(env.rank, env.world_size, env.init_method,
                          config.runtime.startup_timeout_s)
    from launcher.session import run_once, serve_forever

    if args.command == "run":
        return run_once(config, env, request, as_json=args.json, quiet=args.quiet)
    return serve_forever(config, env, http=http, metrics=metrics, quiet=args.quiet)


def _request_from_args(args, is_default: bool) -> dict:
    from runtime.params import SamplingParams

    if args.prompt is None and args.prompt_ids is None:
        if not is_default:
            raise ValueError("run: give --prompt TEXT or --prompt-ids 1,2,3")
        args.prompt = ["What is speculative decoding? Answer in two sentences."]
    params = SamplingParams.from_kwargs(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=args.stop or ()).to_dict()
    id_lists = None
    if args.prompt_ids is not None:
        id_lists = [_parse_ids(text) for text in args.prompt_ids]
    elif not all(args.prompt):
        raise ValueError("--prompt: empty prompt")
    chat = is_default if args.chat is None else args.chat
    return {"prompts": None if id_lists else args.prompt, "prompt_ids": id_lists,
            "params": params, "chat": chat}


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, "
                         f"got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids: empty prompt")
    return ids


def _worker(args) -> int:
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
    return run_worker(rank, args.world_size, args.init_method, args.startup_timeout)
