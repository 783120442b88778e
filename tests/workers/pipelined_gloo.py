"""Many collectives in flight on gloo while the rank computes on those that landed, as `hp.mpmd` runs them.

Each round cuts a [2, 256, 512] block into 4 token chunks and issues every
chunk's all-gather, reduce-scatter and all-to-all at once through
`hp.ops.collectives`, then multiplies each landed gather while the later
ones fly. Every result is checked against the same collective waited alone.
Functional collectives corrupted the heap under this pattern on gloo (a crash
within a few hundred rounds); this worker must finish every round and print
"ok <rank>".

    python -m torch.distributed.run --nproc-per-node 2 tests/workers/pipelined_gloo.py [rounds]
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp.ops.collectives import (ALL_REDUCE, REDUCE_SCATTER, all_gather, all_reduce, all_to_all, issue_all_gather,
                                issue_all_reduce, issue_all_to_all, issue_reduce_scatter, landed_gather,
                                reduce_scatter)
from hp.ops.overlap import wait

CHUNKS = 4


def one_round(step: int, group, weight: torch.Tensor) -> None:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2, 256, 512, generator=torch.Generator().manual_seed(step * ranks + rank))
    pieces = x.split(256 // CHUNKS, 1)
    gathers = [issue_all_gather(p, 1, group) for p in pieces]
    scatters = [issue_reduce_scatter(p, 1, group) for p in pieces]
    sums = [issue_all_reduce(p[:, :8], "sum", group) for p in pieces]
    splits = [[(step + c + r) % 5 for r in range(ranks)] for c in range(CHUNKS)]
    received = [[0] * ranks for _ in range(CHUNKS)]
    for c in range(CHUNKS):  # what each rank sends this rank, known to all from the formula
        for source in range(ranks):
            received[c][source] = (step + c + rank) % 5
    rows = [torch.full((sum(splits[c]), 3), float(rank * 100 + c)) for c in range(CHUNKS)]
    exchanges = [issue_all_to_all(rows[c], received[c], splits[c], group) for c in range(CHUNKS)]
    for c, pending in enumerate(gathers):  # each landed chunk multiplied while the later ones fly
        landed = landed_gather(pending, 1)
        torch.testing.assert_close(F.linear(landed, weight), F.linear(all_gather(pieces[c], 1, group), weight))
    for c in range(CHUNKS):
        torch.testing.assert_close(wait(scatters[c], REDUCE_SCATTER), reduce_scatter(pieces[c], 1, group))
        torch.testing.assert_close(wait(sums[c], ALL_REDUCE), all_reduce(pieces[c][:, :8], "sum", group))
        got = wait(exchanges[c], "all_to_all")
        want = torch.cat([torch.full((received[c][s], 3), float(s * 100 + c)) for s in range(ranks)])
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(all_to_all(rows[c], received[c], splits[c], group), want)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    for step in range(rounds):
        one_round(step, dist.group.WORLD, weight)
    dist.barrier()
    print(f"ok {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
