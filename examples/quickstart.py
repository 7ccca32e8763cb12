"""The Python API in 30 lines, on the built-in demo model (SmolLM2-135M on the CPU; its draft is
the target itself, so it shows the mechanism and exactness, not a speed-up):

    python examples/quickstart.py
"""

from runtime import Engine
from runtime.config import default_config

PROMPT = "The three primary colors are"

if __name__ == "__main__":
    config = default_config()  # or a YAML path: Engine.launch("config.yaml")
    with Engine.launch(config) as engine:  # starts the orchestrator and the workers
        out = engine.generate(PROMPT, max_new_tokens=24)  # greedy: the target's own
        print(f"{PROMPT!r} -> {out.text!r}")
        print(
            f"  {len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
            f"acceptance={out.stats['acceptance_rate']:.2f}, rounds={out.stats['rounds']}"
        )

        outs = engine.generate(
            ["Water boils at", "The moon is"], max_new_tokens=12, temperature=0.8, seed=7
        )  # a batch, sampled
        for o in outs:
            print(f"  sampled: {o.text!r}")

        print(f"{PROMPT!r} (streamed) -> ", end="", flush=True)
        for delta in engine.stream(PROMPT, max_new_tokens=24):  # tokens as they commit
            print(delta.text, end="", flush=True)
        print()
