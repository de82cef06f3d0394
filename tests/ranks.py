"""Run a test body in N processes with an initialized process group.

    run_ranks(2, body, arg1, arg2)      # body(arg1, arg2) runs on ranks 0 and 1 (gloo, CPU)

Each rank gets a free TCP port rendezvous, one CPU thread, and a clean teardown. If any rank
raises, the others are killed at once (they would otherwise wait forever in a collective) and the
test fails with every rank's traceback; if nothing finishes within `timeout`, the test fails
instead of hanging CI. `body` must be a module-level function (it is pickled into the children).

RANKS_SHARE_GPU=1 (opt-in, for a machine with one GPU): every NCCL rank runs on cuda:0, each
with its own NCCL_HOSTID, so NCCL takes the ranks for separate hosts and joins them over its
socket transport instead of refusing "Duplicate GPU detected". NCCL does not support this: the
numerics are real, the timings mean nothing, and it may hang (the timeout below still ends it).
conftest.py then counts the one GPU as two, so the 2-GPU tests run.
"""

import multiprocessing
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharing_one_gpu() -> bool:
    return os.environ.get("RANKS_SHARE_GPU") == "1"


def _entry(rank, world_size, port, backend, body, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if "nccl" in backend:  # "nccl", or "cpu:gloo,cuda:nccl" (host-resident model state)
            if sharing_one_gpu():
                os.environ.update(NCCL_HOSTID=f"shared-gpu-rank-{rank}", NCCL_P2P_DISABLE="1",
                                  NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
            torch.cuda.set_device(0 if sharing_one_gpu() else rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        body(*args)
        dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, body, *args, backend: str = "gloo", timeout: float = 300.0):
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world_size, port, backend, body, args, errors))
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
    messages = []
    while not errors.empty():
        rank, tb = errors.get()
        messages.append(f"--- rank {rank} ---\n{tb}")
    if timed_out:
        raise AssertionError(f"ranks did not finish within {timeout}s (hang?)\n" + "\n".join(messages))
    if failed or any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"a rank failed (exit codes {codes})\n" + "\n".join(messages))
