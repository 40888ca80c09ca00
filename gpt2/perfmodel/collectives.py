"""Collective communication times: ring algorithms with a latency and a bandwidth term.

For p devices, n bytes per device, link bandwidth bw (bytes/s, one direction) and
per-message latency lat:
  all-reduce      2(p-1) lat + 2 (p-1)/p n / bw      (reduce-scatter then all-gather)
  reduce-scatter   (p-1) lat +   (p-1)/p n / bw
  all-gather       (p-1) lat +   (p-1)/p n / bw      (n: the gathered size)
  all-to-all       (p-1) lat +   (p-1)/p n / bw      (pairwise exchange)
  point-to-point         lat +           n / bw
Every collective over one device, or of zero bytes, takes exactly zero time.
"""


def _check(nbytes, p, bandwidth):
    if p < 1:
        raise ValueError(f"collective group size must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"collective size must be >= 0 bytes, got {nbytes}")
    if p > 1 and nbytes > 0 and not bandwidth > 0:
        raise ValueError(f"a collective over {p} devices needs a link bandwidth > 0 (the hardware "
                         f"profile's interconnect), got {bandwidth}")


def all_reduce(nbytes, p, bandwidth, latency):
    _check(nbytes, p, bandwidth)
    if p == 1 or nbytes == 0:
        return 0.0
    return 2 * (p - 1) * latency + 2 * (p - 1) / p * nbytes / bandwidth


def reduce_scatter(nbytes, p, bandwidth, latency):
    _check(nbytes, p, bandwidth)
    if p == 1 or nbytes == 0:
        return 0.0
    return (p - 1) * latency + (p - 1) / p * nbytes / bandwidth


all_gather = reduce_scatter
all_to_all = reduce_scatter


def point_to_point(nbytes, bandwidth, latency):
    _check(nbytes, 2, bandwidth)
    if nbytes == 0:
        return 0.0
    return latency + nbytes / bandwidth
