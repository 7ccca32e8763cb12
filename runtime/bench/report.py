"""The benchmark's output: one row per (mode, batch size), a printed table, the JSON file."""

from __future__ import annotations

import datetime
import json
import os
import platform

FIGURES = (
    "tokens_per_s",
    "speedup_over_target",
    "acceptance_rate",
    "mean_accepted_tokens",
    "c",
    "theoretical_speedup",
    "efficiency",
    "roofline_fraction",
    "decode_roofline_fraction",
)


def row(
    mode: str, batch_size: int, status: str = "ok", reason: str | None = None, **values
) -> dict:
    """A result row: every figure is present, None where it does not apply to the mode."""
    out = {"mode": mode, "batch_size": batch_size, "status": status, "reason": reason}
    out.update(dict.fromkeys(FIGURES))
    out["alpha"] = None
    out.update(values)
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware(device_type: str, device_index: int | None) -> dict:
    import torch

    info = {
        "device_type": device_type,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    if device_type == "cuda":
        index = device_index or 0
        info["device"] = torch.cuda.get_device_name(index)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = info["cpu"]
    return info


def versions() -> dict:
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ms(seconds: list | None) -> str:
    """The median of a row's per-request seconds, in milliseconds."""
    known = sorted(x for x in seconds or () if x is not None)
    return f"{known[len(known) // 2] * 1e3:.1f}" if known else "-"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(rows: list[dict]) -> str:
    """Markdown table of the rows (skipped/failed rows carry their reason). `speed-up` is the
    row's tokens/s over the `target` row's at the same batch size."""
    head = [
        "mode",
        "batch",
        "tokens/s",
        "speed-up",
        "acceptance",
        "tokens/round",
        "alpha",
        "c",
        "theoretical",
        "efficiency",
        "roofline",
        "decode roofline",
        "ttft ms",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            note = f"{r['status']}: {r['reason']}"
        else:
            note = r.get("note") or ""
        cells = [
            r["mode"],
            str(r["batch_size"]),
            _fmt(r["tokens_per_s"], 1),
            _ratio(r.get("speedup_over_target")),
            _fmt(r["acceptance_rate"]),
            _fmt(r["mean_accepted_tokens"]),
            _fmt(r.get("alpha")),
            _fmt(r["c"], 3),
            _fmt(r["theoretical_speedup"]),
            _fmt(r["efficiency"]),
            _fmt(r["roofline_fraction"], 3),
            _fmt(r["decode_roofline_fraction"], 3),
            _ms(r.get("time_to_first_token_s")),
            note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: str, report: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1, allow_nan=False)
        fh.write("\n")
    os.replace(tmp, path)
