import os
import sys

# Every worker starts here (`python -m launcher worker`, or a rank that torchrun or mpirun
# pre-started with `python -m launcher run|serve`), before torch loads its OpenMP runtime,
# which reads the wait policy once, as it loads: idle intra-op threads then sleep at once
# instead of spinning on the cores that another busy process needs (docs/configuration.md,
# "CPU threads"). A policy already in the environment wins. Not for `bench`: its in-process
# modes keep torch's defaults, as under `tandem bench` (which does not start here).
if sys.argv[1:2] in (["run"], ["serve"], ["worker"]):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from launcher.cli import main

sys.exit(main())
