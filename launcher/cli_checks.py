"""What `tandem run` and `tandem serve` ask for, loaded and checked before any process
starts, on every rank: the config with the command line's overrides, the run's request,
serve's HTTP endpoints, and where the launcher put this rank (a LaunchPlan). Errors are
ValueErrors (or runtime.config.ConfigError, parallel.topology.LaunchError) naming the flag
or the config key; launcher/cli.py reports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config is imported lazily: --help and --version stay fast
    from launcher.discovery import LaunchEnv
    from runtime.api.http.access import HttpAccess
    from runtime.config import TandemConfig

DEMO_PROMPT = "What is speculative decoding? Answer in two sentences."


@dataclass
class LaunchPlan:
    """A checked `run` or `serve`: what to start, and this rank's place."""

    config: TandemConfig
    env: LaunchEnv
    request: dict | None  # run's (request_from_args)
    http: tuple[str, int] | None  # serve's OpenAI-compatible HTTP API
    metrics: tuple[str, int] | None  # serve's Prometheus endpoint
    http_access: HttpAccess | None = None  # the HTTP API's key and TLS files (rank 0's)


def plan_launch(args, config: TandemConfig) -> LaunchPlan:
    """The command's request and endpoints, and this rank's launch environment, checked
    against the config: world size, control address, nodes."""
    from launcher.bootstrap import control_bind
    from launcher.discovery import discover
    from runtime.control.auth import check_control_bind

    request = request_from_args(args, config) if args.command == "run" else None
    http, metrics = serve_endpoints(args, config) if args.command == "serve" else (None, None)
    env = discover()
    check_control_bind(control_bind())  # beyond loopback only with a key, on every rank
    topology = config.topology()
    if env.world_size is not None:
        topology.check_world_size(env.world_size)
    _check_nodes(config, env)
    access = None
    if http is not None and env.is_orchestrator:  # the files are rank 0's to read
        from runtime.api.http.access import http_access

        access = http_access(
            args.api_key, config.server.api_key_file, args.ssl_keyfile, args.ssl_certfile
        )
    return LaunchPlan(config, env, request, http, metrics, access)


def _check_nodes(config, env) -> None:
    """Devices that name their node against where the launcher put the ranks, on every rank
    (runtime.config.nodes); on several nodes also this node's CUDA indices, which rank 0's
    config checks cannot see."""
    from runtime.config.nodes import check_nodes

    def cuda_count() -> int:
        import torch

        return torch.cuda.device_count()

    check_nodes(config, env.layout, cuda_count if env.layout.nodes > 1 else None)


def config_from_args(args, check_devices: bool) -> TandemConfig:
    """The config of `run`/`serve` (the built-in demo's without one), with the command
    line's overrides."""
    from runtime.config import default_config, load_config

    if args.config is None:
        config = default_config()
    else:
        config = load_config(args.config, check_devices=check_devices)
    server = _server_overrides(args) if args.command == "serve" else {}
    if server:
        raw = config.to_dict()  # the other server keys stay as the config says
        config = load_config(
            dict(raw, server=dict(raw["server"], **server)),
            check_files=False,
            check_devices=False,
        )
    return config


def _server_overrides(args) -> dict:
    """The server keys that serve's flags set: --address, --tool-call-parser,
    --shutdown-timeout."""
    values = {"address": args.address, "tool_parser": args.tool_call_parser}
    overrides = {key: value for key, value in values.items() if value}
    if args.shutdown_timeout is not None:
        overrides["shutdown_timeout_s"] = args.shutdown_timeout
    return overrides


def serve_endpoints(args, config: TandemConfig) -> tuple:
    """(http, metrics): the (host, port) of `serve`'s optional HTTP fronts, or None each.
    A non-loopback --http needs --http-allow-remote or an API key."""
    from runtime.api.http.access import REMOTE_NEEDS, api_key_given
    from runtime.api.http.address import parse_http_address

    if args.served_model_name is not None:
        if not args.served_model_name.strip():
            raise ValueError("--served-model-name: expected a non-empty name")
        if args.http is None:
            raise ValueError(
                "--served-model-name: only the HTTP API names the model; give --http HOST:PORT too"
            )
    _check_http_flags(args)
    http = metrics = None
    if args.http is not None:
        keyed = api_key_given(args.api_key, config.server.api_key_file)
        http = parse_http_address(
            args.http, args.http_allow_remote or keyed, remote_needs=REMOTE_NEEDS
        )
    if args.metrics is not None:
        metrics = parse_http_address(
            args.metrics, args.metrics_allow_remote, flag="--metrics", what="the metrics endpoint"
        )
    return http, metrics


def _check_http_flags(args) -> None:
    """The HTTP API's flags mean nothing without it."""
    flags = {
        "--api-key": args.api_key,
        "--ssl-keyfile": args.ssl_keyfile,
        "--ssl-certfile": args.ssl_certfile,
        "--tool-call-parser": args.tool_call_parser,
    }
    for flag, value in flags.items():
        if value is not None and args.http is None:
            raise ValueError(f"{flag}: applies to the HTTP API; give --http HOST:PORT too")


def request_from_args(args, config) -> dict:
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
        # in the API's words, which launcher/cli.py turns into --prompt-ids, --max-new-tokens
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
