"""Run a test body in N processes with an initialized process group.

    run_ranks(2, body, arg1, arg2)      # body(arg1, arg2) runs on ranks 0 and 1 (gloo, CPU)

Each rank is a fresh process with one CPU thread and a clean teardown. The ranks meet at a
TCPStore that this (the parent) process serves for their whole run, on a port it bound and keeps
(a free port picked, released and handed to the ranks could be taken by any other process before
rank 0 binds it); each rank joins as a client and passes the store to init_process_group, which
works alike for gloo and NCCL (NCCL exchanges its unique id through the store). On Linux the
processes fork from a server that imported torch once for the session (multiprocessing's
forkserver), so a rank starts in milliseconds instead of importing torch again (seconds of CPU
per rank, per test). If any rank raises, the others are killed at once (they would otherwise wait
forever in a collective) and the test fails with every rank's traceback; if nothing finishes
within `timeout`, the test fails instead of hanging CI. `body` must be a module-level function
(it is pickled into the children).

NCCL ranks take one GPU each; with fewer GPUs than ranks (one H200, say) they share them
(rank r on GPU r mod count), each told it is a host of its own (NCCL_HOSTID), so NCCL connects
them over its socket transport on the loopback instead of refusing two ranks on one GPU. Every
multi-GPU test runs so on one GPU (docs/gpu_tests.json): what it checks is the numbers and the
bytes, which sharing does not change; what would need a second GPU to mean anything (time,
links) is not measured by tests.
"""

import multiprocessing
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=120)  # of the rendezvous and of every collective


def _serve_store() -> dist.TCPStore:
    """The ranks' rendezvous, served from this process on a port the OS picks (0) and that stays
    bound while the returned store lives: no rank has to bind it."""
    return dist.TCPStore(HOST, 0, None, True, TIMEOUT, wait_for_workers=False)


def _entry(rank, world_size, port, backend, body, args, errors):
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl" (host-resident model state)
            gpus = torch.cuda.device_count()
            if gpus < world_size:  # ranks share GPUs, each a host of its own (module docstring)
                os.environ.update(NCCL_HOSTID=f"rank{rank}-of-{world_size}", NCCL_IB_DISABLE="1",
                                  NCCL_NVLS_ENABLE="0")
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
            torch.cuda.set_device(rank % gpus)
        store = dist.TCPStore(HOST, port, world_size, False, TIMEOUT)  # the parent's
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=TIMEOUT)
        body(*args)
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once by the fork server. Not the repository's own modules where CUDA exists: a module
# that asked the CUDA driver anything at import would leave the forked ranks unable to use it.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "einops", "numpy"]
REPOSITORY_PRELOAD = ["train", "reference"]


def _context():
    """forkserver on Linux, else spawn (macOS forbids some libraries' use after a fork): never
    plain fork, which would copy pytest's own threads and state into the ranks."""
    if not sys.platform.startswith("linux"):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + ([] if torch.cuda.is_available() else REPOSITORY_PRELOAD))
    return ctx


def run_ranks(world_size: int, body, *args, backend: str = "gloo", timeout: float = 300.0):
    ctx = _context()
    errors = ctx.Queue()
    store = _serve_store()  # kept until the ranks are gone
    procs = [ctx.Process(target=_entry,
                         args=(rank, world_size, store.port, backend, body, args, errors))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed = timed_out = False
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            failed = True
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    del store  # every rank has ended: the port is free again
    messages = []
    while not errors.empty():
        rank, tb = errors.get()
        messages.append(f"--- rank {rank} ---\n{tb}")
    if timed_out:
        raise AssertionError(f"ranks did not finish within {timeout}s (hang?)\n"
                             + "\n".join(messages))
    if failed or any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"a rank failed (exit codes {codes})\n" + "\n".join(messages))
