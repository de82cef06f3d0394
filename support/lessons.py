"""The numbered lessons, imported by name in this one place (a module name cannot start with a
digit). support/, the commands and bench/ take them from here:

    from support.lessons import (sharding, ulysses_sp, checkpointing, tiling, untied_sp, ring_sp,
                                 activation_offload, optimizer_overlap, moments_offload)

Each alias says what the file holds and is never the name of a flag or a Runtime field
(`cfg.ulysses` is a flag, `rt.ulysses` a degree, `ulysses_sp` the module). The lessons import
each other by file name (05 and 06 import 02, 06 imports 05), and tests may too.

Each lesson is one module in a process: `python 03_checkpoint_offload.py` runs the file as
`__main__`, and its demo then imports support/, which would load the same file a second time
under its name (two BlockInputOffloader classes, and an isinstance that is silently false). So
the running script is registered under its name first, before any lesson is imported.
"""

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("01_fsdp", "02_ulysses", "03_checkpoint_offload", "04_alst_tiling",
         "05_untied_ulysses", "06_ring_attention", "07_offload_activations",
         "08_optimizer_overlap", "09_offload_moments")



def register_running_lesson() -> None:
    """A lesson run as a script (`__main__`) is that lesson's module from now on."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and Path(script).resolve().parent == ROOT and Path(script).stem in NAMES:
        sys.modules.setdefault(Path(script).stem, main)


register_running_lesson()
(sharding, ulysses_sp, checkpointing, tiling, untied_sp, ring_sp, activation_offload,
 optimizer_overlap, moments_offload) = (importlib.import_module(name) for name in NAMES)
