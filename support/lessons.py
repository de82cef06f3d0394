"""The numbered lessons, imported by name in this one place (a module name cannot start with a
digit). Everything outside the numbered files takes them from here:

    from support.lessons import sharding, ulysses_sp, checkpointing, tiling, untied_sp, ring_sp

Each alias says what the file holds and is never the name of a flag or a Runtime field
(`cfg.ulysses` is a flag, `rt.ulysses` a degree, `ulysses_sp` the module).
"""

import importlib

sharding = importlib.import_module("01_fsdp")
ulysses_sp = importlib.import_module("02_ulysses")
checkpointing = importlib.import_module("03_checkpoint_offload")
tiling = importlib.import_module("04_alst_tiling")
untied_sp = importlib.import_module("05_untied_ulysses")
ring_sp = importlib.import_module("06_ring_attention")
