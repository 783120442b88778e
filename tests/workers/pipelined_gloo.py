"""Many collectives in flight on gloo while the rank computes on those that landed, as `hp.mpmd` runs them.

Each round cuts a [2, 256, 512] block into 4 token chunks and issues every
chunk's all-gather, reduce-scatter and all-to-all at once through
`hp.ops.collectives`, then multiplies each landed gather while the later
ones fly. Every result is checked against the arithmetic on every rank's
block (each rank regenerates them all from the round's seeds).
Functional collectives corrupted the heap under this pattern on gloo (a crash
within a few hundred rounds); this worker must finish every round and print
"ok <rank>". One round also runs inside `hp.mpmd`'s timing and
`hp.comm.trace`: the reduce-scatters (all-to-alls on gloo) are counted as
reduce-scatters with their ring bytes, and a collective waited for long
after it landed shows its landing (from gloo's future), not its wait.

    python -m torch.distributed.run --nproc-per-node 2 tests/workers/pipelined_gloo.py [rounds]
"""

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp.ops.collectives import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, all_gather, issue_all_gather,
                                issue_all_reduce, issue_all_to_all, issue_reduce_scatter)
from hp.comm import trace
from hp.cost import ring_bytes
from hp.ops.overlap import pipelined, wait

CHUNKS = 4


def block_of(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s [2, 256, 512] block of round `step`: every rank can make every rank's."""
    return torch.randn(2, 256, 512, generator=torch.Generator().manual_seed(step * 1000 + rank))


def one_round(step: int, group, weight: torch.Tensor) -> None:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    blocks = [block_of(step, r) for r in range(ranks)]
    pieces = [b.split(256 // CHUNKS, 1) for b in blocks]  # pieces[r][c]: rank r's chunk c
    mine = pieces[rank]
    gathers = [issue_all_gather(p, 1, group) for p in mine]
    scatters = [issue_reduce_scatter(p, 1, group) for p in mine]
    sums = [issue_all_reduce(p[:, :8], "sum", group) for p in mine]
    sends = [[(step + c + r) % 5 for r in range(ranks)] for c in range(CHUNKS)]  # rows to rank r
    gets = [[(step + c + rank) % 5] * ranks for c in range(CHUNKS)]  # every rank sends this one as many
    exchanges = [issue_all_to_all(torch.full((sum(sends[c]), 3), float(rank * 100 + c)), gets[c], sends[c], group)
                 for c in range(CHUNKS)]
    for c, pending in enumerate(gathers):  # each landed chunk multiplied while the later ones fly
        whole = torch.cat([pieces[r][c] for r in range(ranks)], 1)
        torch.testing.assert_close(F.linear(wait(pending, ALL_GATHER).movedim(0, 1), weight), F.linear(whole, weight))
        # a gather waited at once among those in flight (the pattern that crashed), against the arithmetic too
        torch.testing.assert_close(all_gather(mine[c], 1, group), whole)
    for c in range(CHUNKS):
        total = sum(pieces[r][c] for r in range(ranks))
        torch.testing.assert_close(wait(scatters[c], REDUCE_SCATTER), total.chunk(ranks, 1)[rank])
        torch.testing.assert_close(wait(sums[c], ALL_REDUCE), total[:, :8])
        want = torch.cat([torch.full((gets[c][s], 3), float(s * 100 + c)) for s in range(ranks)])
        torch.testing.assert_close(wait(exchanges[c], ALL_TO_ALL), want)


def counted_and_timed(group, weight: torch.Tensor) -> None:
    with trace() as seen, pipelined(CHUNKS) as waits:
        one_round(0, group, weight)
        late = issue_all_reduce(torch.ones(1024), "sum", group)
        time.sleep(0.2)  # landed long before this wait
        torch.testing.assert_close(wait(late, ALL_REDUCE), torch.full((1024,), float(dist.get_world_size())))
    piece = 2 * (256 // CHUNKS) * 512 * 4  # one chunk's bytes, fp32
    assert seen.count(REDUCE_SCATTER) == CHUNKS, seen.table()
    assert seen.bytes(REDUCE_SCATTER) == CHUNKS * ring_bytes(REDUCE_SCATTER, piece, dist.get_world_size())
    assert seen.count(ALL_TO_ALL) + seen.count("send_recv") == CHUNKS, seen.table()  # the exchanges only
    assert all(s.issued <= s.waited and s.issued <= s.landed for s in waits.spans), waits.spans
    last = waits.spans[-1]
    assert last.landed <= last.waited and last.waited - last.issued >= 0.2, last


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # narrow: the products only need to run while later collectives fly; at 256 outputs they took most of the time
    weight = torch.randn(32, 512, generator=torch.Generator().manual_seed(0))
    counted_and_timed(dist.group.WORLD, weight)
    for step in range(rounds):
        one_round(step, dist.group.WORLD, weight)
    dist.barrier()
    print(f"ok {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
