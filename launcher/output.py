"""What `tandem run` prints: each prompt's text on stdout, streamed as it is generated, then
its stats line on stderr; with --json one JSON object per prompt once all are done.

Several prompts run as one batch but print one after another: the first streams, and a later
prompt's text (held meanwhile) follows as soon as the prompts before it are done, so texts
never interleave. Interrupted, whatever was generated is printed, and nothing else."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable

from runtime.serving.sequence import EventKind

DEMO_NOTE = """\
tandem: demo: SmolLM2-135M-Instruct on the CPU is both draft and target, so every draft
  token is accepted (acceptance 1.00, tokens/round = draft_len + 1) and nothing is gained:
  it shows the mechanism, and that the output is exactly the target's. A shallow draft cut
  from SmolLM2's own layers agrees with it on only 3-20% of tokens, which would be slower.
  Speculation pays where decoding is bound by memory bandwidth, on a GPU: `tandem bench
  --synthetic 8b --device cuda:0` (README, Results); your own models: `tandem run CONFIG`."""


class LastWords:
    """Text for stdout that must come out once and whole, even when a second signal ends the
    process at once (launcher.session._Interrupt): `write()` writes it (built by `make` when
    written); `exit_now(code)`, from that signal's handler, writes it unless it is out and
    ends the process, or, when the handler interrupted `write()` itself (it runs in the main
    thread, between two of its steps), lets that write finish and end the process then."""

    wrote_any = False  # class-wide: has this process written its last words (main's check)

    def __init__(self, make: Callable[[], str]):
        self.make = make
        self.state: str | None = None  # None -> "writing" -> "written"
        self.exit_code: int | None = None  # set by exit_now during write()

    def write(self) -> None:
        if self.state is not None:
            return
        data = self.make().encode()
        sys.stdout.flush()
        self.state = "writing"
        LastWords.wrote_any = True
        try:
            _write_all(sys.stdout.fileno(), data)
        finally:
            self.state = "written"
        if self.exit_code is not None:
            os._exit(self.exit_code)

    def exit_now(self, code: int) -> None:
        """End the process with `code` once the text is out (returns only into a write())."""
        if self.state == "writing":
            self.exit_code = code
            return
        self.write()
        os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # stdout closed (a reader gone): nobody to tell
        pass


def json_error(message: Callable[[], str]) -> LastWords:
    """--json's output when there is nothing to report (interrupted before the prompts were
    read): one object, {"error": message()}."""
    return LastWords(lambda: json.dumps({"error": message()}) + "\n")


class RunOutput:
    """Prints one `tandem run` request's outputs from the orchestrator's step events."""

    def __init__(self, seqs, as_json: bool, stream: bool, profile=lambda: {}):
        self.seqs = seqs  # runtime.serving.scheduler.Sequence, in order
        self.as_json = as_json
        self.stream = stream and not as_json
        self.profile = profile  # the orchestrator's per-phase timings
        # --json: one object per prompt, finish_reason "cancelled" where unfinished, written
        # once whichever way the run ends (finished, interrupted, a second signal)
        self.json = LastWords(self._json_text) if as_json else None
        self.held = [""] * len(seqs)  # text generated and not printed yet
        self.done = [False] * len(seqs)  # retired (its stats are final)
        self.next = 0  # the first prompt not printed in full
        self.line_open = False  # stdout has text after its last newline

    def event(self, event) -> None:
        """One event of Orchestrator.step()."""
        i = event.seq.index
        if event.kind is EventKind.DELTA:
            self.held[i] += event.text
        elif event.kind is EventKind.FINAL:
            self.done[i] = True
        if self.stream:
            self._print_ready(everything=False)

    def finish(self) -> None:
        """Every prompt is done: print what is left."""
        if self.json is not None:
            self.json.write()
        else:
            self._print_ready(everything=True)

    def interrupted(self) -> int:
        """Stopped early: print what each prompt generated (no stats lines; --json: the
        objects, finish_reason "cancelled" where unfinished); returns the tokens generated."""
        if self.json is not None:
            self.json.write()
        else:
            for i in range(self.next, len(self.seqs)):
                self._write(i)
                self._end_line()
        return sum(len(seq.generated) for seq in self.seqs)

    def end_line(self) -> None:
        """Before a word on stderr (an error): end the text streamed so far with a newline."""
        if self.line_open:
            self._end_line()

    # --- printing ---------------------------------------------------------------------------
    def _print_ready(self, everything: bool) -> None:
        while self.next < len(self.seqs):
            self._write(self.next)
            if not (self.done[self.next] or everything):
                return
            self._end_line()
            self._stats_line(self._output(self.seqs[self.next]))
            self.next += 1

    def _write(self, i: int) -> None:
        if self.held[i]:
            sys.stdout.write(self.held[i])
            sys.stdout.flush()
            self.held[i] = ""
            self.line_open = True

    def _end_line(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()
        self.line_open = False

    def _json_text(self) -> str:
        lines = []
        for seq in self.seqs:
            out = self._output(seq)
            out["finish_reason"] = out["finish_reason"] or "cancelled"
            lines.append(json.dumps(out) + "\n")
        return "".join(lines)

    def _output(self, seq) -> dict:
        out = seq.output()
        out.pop("index")
        profile = self.profile()
        if profile:
            out["stats"]["profile"] = profile
        return out

    @staticmethod
    def _stats_line(out: dict) -> None:
        s = out["stats"]
        print(
            f"[{len(out['token_ids'])} tokens, finish={out['finish_reason']}, "
            f"acceptance={s['acceptance_rate']:.2f}, "
            f"tokens/round={s['mean_accepted_tokens']:.2f}, "
            f"{s['tokens_per_s']:.1f} tokens/s]",
            file=sys.stderr,
            flush=True,
        )


def print_demo_header(prompts: list[str] | None) -> None:
    """The built-in demo says what it shows (and what it does not) and echoes its prompt."""
    print(DEMO_NOTE, file=sys.stderr)
    for prompt in prompts or ():
        print(f"prompt: {prompt}", file=sys.stderr)
    sys.stderr.flush()


# Python argument names in tandem's messages -> what the `tandem run` user typed.
_FLAG_NAMES = {
    "prompt_token_ids": "--prompt-ids",
    "max_new_tokens": "--max-new-tokens",
    "top_k": "--top-k",
    "top_p": "--top-p",
}
_LEADING_FLAGS = ("prompt", "temperature", "seed", "stop")  # only as a message's subject


def flag_message(message: str) -> str:
    """An error message of the Python API ('top_p: ...', 'prompt_token_ids: ...') in the
    CLI's words ('--top-p: ...', '--prompt-ids: ...'). Not for a ConfigError: it names config
    keys, which are no flags (runtime.max_seq_len, and a section's keys as listed)."""
    for name, flag in _FLAG_NAMES.items():
        message = re.sub(rf"(?<![\w.-]){name}\b", flag, message)
    subject = re.match(r"(\w+):", message)
    if subject and subject.group(1) in _LEADING_FLAGS:
        message = f"--{message}"
    return message
