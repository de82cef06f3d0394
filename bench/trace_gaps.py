"""Why the compute stream sat idle: each gap in a torch.profiler Chrome trace, classified.

    python -m bench.trace_gaps TRACE.json.gz [--min-ms 1] [--rows 40]

A step's trace (`bench.step --profile --trace FILE`) holds the GPU's kernels and copies with the
host's launch call of each (the same correlation id). For every gap longer than `--min-ms` on
the main compute stream (the one with the most kernel time), the time until the host launched
the kernel after it is the host's (Python, a synchronization), and the rest the GPU's: the
kernel was queued and waited for an event (a copy, another stream's work). The row names the
work on another stream that ended closest before the gap did, the wait's likely cause.
"""

import argparse
import gzip
import json
from collections import defaultdict

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def gaps(events: list, min_us: float = 1000.0) -> list:
    """The main compute stream's gaps of at least `min_us`, each a dict: start_ms (from the
    trace's first GPU event), ms, host_ms (from the gap's start to the next kernel's launch;
    0 where it was launched before or the trace has no launch), waiting_ms (the rest), next
    (the kernel's name), cause (the other streams' work that ended last before the gap did, or
    None) and cause_stream."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in spans if e.get("cat") in GPU_WORK]
    if not gpu:
        return []
    launches = {e["args"]["correlation"]: e for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    by_stream = defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    main = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s]
                                            if e["cat"] == "kernel"))
    others = [e for stream, es in by_stream.items() if stream != main for e in es]
    first = min(e["ts"] for e in gpu)
    found, end = [], None
    for e in sorted(by_stream[main], key=lambda e: e["ts"]):
        if end is not None and e["ts"] - end >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            ended = [o for o in others if end < o["ts"] + o["dur"] <= e["ts"]]
            cause = max(ended, key=lambda o: o["ts"] + o["dur"], default=None)
            host = 0 if launch is None else min(max(launch["ts"] - end, 0), e["ts"] - end)
            found.append({
                "start_ms": (end - first) / 1e3, "ms": (e["ts"] - end) / 1e3,
                "host_ms": host / 1e3, "waiting_ms": (e["ts"] - end - host) / 1e3,
                "next": e["name"], "cause": cause and cause["name"],
                "cause_stream": cause and cause.get("args", {}).get("stream")})
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    return found


def summary(found: list) -> str:
    late, waited = (sum(g[key] for g in found) for key in ("host_ms", "waiting_ms"))
    return (f"main-stream gaps: {len(found)}; the host late {late:.1f} ms, "
            f"the GPU waiting {waited:.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--min-ms", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=40)
    opts = parser.parse_args()
    with (gzip.open if opts.trace.endswith(".gz") else open)(opts.trace, "rt") as f:
        found = gaps(json.load(f)["traceEvents"], opts.min_ms * 1e3)
    print(summary(found))
    for g in found[:opts.rows]:
        print(f"{g['start_ms']:9.1f} ms: {g['ms']:6.2f} ms (the host {g['host_ms']:.2f}, "
              f"waiting {g['waiting_ms']:.2f}), next {g['next'][:40]}; "
              f"{g['cause'] or 'nothing'} (stream {g['cause_stream']}) ended last before it")


if __name__ == "__main__":
    main()
