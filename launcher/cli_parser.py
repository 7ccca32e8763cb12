"""The `tandem` command line: its commands (run, serve, bench) and their options, with help
that gives each default, and the hidden `worker` entry's. What the commands do with the
parsed arguments: launcher/cli.py (and launcher/cli_checks.py, launcher/bench.py)."""

from __future__ import annotations

import argparse
import math

from launcher.cli_checks import DEMO_PROMPT


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
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
    from runtime.version import installed_version

    return installed_version() or "unknown (not installed; pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    """The public command line (the hidden `worker` entry has its own: worker_parser)."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        formatter_class=HelpFormatter,
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
            formatter_class=HelpFormatter,
            description="Generate for one prompt (or a batch) and exit. The "
            "text streams to stdout; stats go to stderr. Ctrl-C "
            "stops with what was generated (exit 130).",
        )
    )
    _add_serve(
        sub.add_parser(
            "serve",
            help="serve clients until SIGINT/SIGTERM",
            formatter_class=HelpFormatter,
            description="Start everything and serve clients at "
            "server.address until SIGINT/SIGTERM.",
        )
    )
    from launcher.bench import add_parser as add_bench_parser

    bench = add_bench_parser(sub)
    bench.formatter_class = HelpFormatter
    _add_quiet(bench)  # its Engine's server writes plain lines anyway
    return parser


def _add_run(run: argparse.ArgumentParser) -> None:
    _add_config(run)
    _add_prompts(run)
    _add_sampling(run)
    _add_run_modes(run)
    _add_print_config(run)
    _add_quiet(run)


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="YAML config (default: the built-in demo, SmolLM2-135M-Instruct on "
        "the CPU as both draft and target)",
    )


def _add_prompts(run: argparse.ArgumentParser) -> None:
    """--prompt TEXT or --prompt-ids IDS, each repeatable."""
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


def _add_sampling(run: argparse.ArgumentParser) -> None:
    """The sampling arguments (runtime.params.SamplingParams')."""
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


def _add_run_modes(run: argparse.ArgumentParser) -> None:
    """How `run` treats its prompts and prints its results."""
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


def _add_print_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective config (defaults filled in) as YAML and exit",
    )


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
    _add_config(serve)
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
    _add_http_options(serve)
    _add_listener(serve, "--metrics", "the Prometheus metrics at GET /metrics")
    serve.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        metavar="S",
        default=None,
        help="SIGTERM drains: requests in flight get S seconds to finish while new ones "
        "are refused (0: stop at once; default: server.shutdown_timeout_s, 20)",
    )
    _add_print_config(serve)
    _add_quiet(serve)


def _add_http_options(serve: argparse.ArgumentParser) -> None:
    """The HTTP API's key and TLS files (runtime/api/http/access.py) and tool-call format;
    each needs --http."""
    from runtime.api.http.access import add_access_flags
    from runtime.config.values import TOOL_PARSERS

    add_access_flags(serve)
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        metavar="NAME",
        help=f"how the HTTP API reads tool calls in chat outputs ({', '.join(TOOL_PARSERS)}; "
        "sets server.tool_parser; default: the config's, else the format the chat template "
        "shows)",
    )


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (argparse names the flag when this raises)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0), got {text!r}")
    return value


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="startup progress as plain lines (where each phase starts and "
        "ends) instead of bars; also the case when stderr is no terminal",
    )


def worker_parser() -> argparse.ArgumentParser:
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
