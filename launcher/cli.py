"""`tandem` / `python -m launcher`: run, serve, bench, and the internal worker entry.

Exit codes: 0 done; 1 the engine died (a worker crashed, a rank went silent); 2 a usage or
config error, found before any process starts wherever it can be; 128 + N stopped by signal
N (130: Ctrl-C). Errors name what the user typed: a dotted config key or a flag.

The options are launcher/cli_parser.py's; what they ask for is loaded and checked in
launcher/cli_checks.py; the sessions that follow are launcher/session.py's."""

from __future__ import annotations

import logging
import os
import signal
import sys

from launcher.cli_checks import LaunchPlan, config_from_args, plan_launch
from launcher.cli_parser import build_parser, worker_parser
from launcher.output import LastWords, flag_message, json_error

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended


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
        return _worker(worker_parser().parse_args(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from launcher.bench import main as bench_main

        return bench_main(args)
    plan = _plan(args)
    if isinstance(plan, int):
        return plan
    return _launch(args, plan)


def _plan(args) -> LaunchPlan | int:
    """`run`'s or `serve`'s LaunchPlan, or the exit code when there is nothing to launch:
    --print-config printed the config, or the command line or the config was refused."""
    from launcher.discovery import multi_node
    from parallel.topology import LaunchError
    from runtime.config import ConfigError

    try:
        config = config_from_args(args, check_devices=not multi_node())
        if args.print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        return plan_launch(args, config)
    except ConfigError as exc:  # names its dotted key, and lists config keys as they are
        return _fail(str(exc))
    except (LaunchError, ValueError, FileNotFoundError) as exc:
        return _fail(flag_message(str(exc)) if args.command == "run" else str(exc))


def _launch(args, plan: LaunchPlan) -> int:
    """This rank's part: a worker's, or the orchestrator's session (run once, or serve)."""
    from launcher.orphan import end_with_launcher

    config, env = plan.config, plan.env
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
        assert plan.request is not None  # request_from_args made it
        return run_once(
            config, env, plan.request, as_json=args.json, quiet=args.quiet, stream=args.stream
        )
    return serve_forever(
        config,
        env,
        http=plan.http,
        metrics=plan.metrics,
        quiet=args.quiet,
        served_model_name=args.served_model_name,
        address_source="--address" if args.address else "server.address",
        http_access=plan.http_access,
    )


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
