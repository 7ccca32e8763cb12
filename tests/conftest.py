"""The suite: tests/unit/ (no processes; a folder per room of runtime/) and tests/e2e/
(launches, faults, fuzzing, serving, HTTP). Checkpoint builders and launch helpers shared by
both live beside this file (checkpoints.py, launch.py, processes.py, model_helpers.py)."""
