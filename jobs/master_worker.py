"""Hand out work items from rank 0 to whichever worker asks next; check the results.

\b
    mpirun -n 4 python jobs/master_worker.py                   # 200 items, 3 workers
    spmd run -n 3 jobs/master_worker.py --items 50 --slow-rank 1
    python jobs/master_worker.py                               # one rank computes everything

Rank 0 is the master: it receives from any source (recv_object with
src=None), so whichever worker asks first gets the next item; when the
items run out it tells each worker to stop. A worker loops: ask (sending
the result of its last item along), compute, ask again. Item i is the sum
of squares of a --rows x --cols block of standard normals seeded by
(--seed, i). The master recomputes every item serially, checks each
result and the total, and prints one line: items, how many each worker
handled, the total, OK. --slow-rank R makes rank R sleep --delay seconds
per item: it then gets fewer items than the others, which is the point
of handing them out on demand rather than in equal shares. With one rank
there are no workers: rank 0 computes every item itself.
"""

import sys
import time

import click
import numpy as np

from spmd import comm, run_command

#: Tags: workers ask (and return a result) on ASK; the master answers on WORK.
ASK, WORK = 1, 2
#: What the master sends instead of an item when there are none left.
STOP = None


def work(item, seed, rows, cols):
    """The sum of squares of item's block: deterministic, the same on every rank."""
    block = np.random.default_rng([seed, item]).standard_normal((rows, cols))
    return float(np.einsum("ij,ij->", block, block))


def master(items, compute):
    """Rank 0 with workers: serve items on demand; return ({item: result}, {worker: count})."""
    results, counts = {}, {w: 0 for w in range(1, comm.size)}
    next_item, working = 0, comm.size - 1
    while working:
        message, worker, _ = comm.recv_object(None, ASK, status=True)
        if message is not None:  # a worker's first request carries no result
            item, value = message
            results[item] = value
            counts[worker] += 1
        if next_item < items:
            comm.send_object(next_item, worker, WORK)
            next_item += 1
        else:
            comm.send_object(STOP, worker, WORK)
            working -= 1
    return results, counts


def worker(compute, delay):
    """Any other rank: ask for items until told to stop; return how many it computed."""
    done, message = 0, None
    while True:
        comm.send_object(message, 0, ASK)
        item = comm.recv_object(0, WORK)
        if item is STOP:
            return done
        if delay:
            time.sleep(delay)
        message = (item, compute(item))
        done += 1


def alone(items, compute, delay):
    """A world of one: rank 0 computes every item itself."""
    results = {}
    for item in range(items):
        if delay:
            time.sleep(delay)
        results[item] = compute(item)
    return results, {0: items}


@click.command(help=__doc__)
@click.option("--items", type=click.IntRange(min=0), default=200, show_default=True,
              help="Work items to hand out.")
@click.option("--rows", type=click.IntRange(min=1), default=128, show_default=True,
              help="Rows of each item's block.")
@click.option("--cols", type=click.IntRange(min=1), default=128, show_default=True,
              help="Columns of each item's block.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the blocks.")
@click.option("--slow-rank", type=int, metavar="R",
              help="Rank R sleeps --delay seconds before each item it computes.")
@click.option("--delay", type=click.FloatRange(min=0), default=0.05, show_default=True,
              help="Seconds the slow rank sleeps per item.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def main(items, rows, cols, seed, slow_rank, delay, quiet):
    rank, size = comm.rank, comm.size
    if slow_rank is not None and not (0 <= slow_rank < size and (size == 1 or slow_rank > 0)):
        # Every rank sees the same options and size, so every rank stops here: say it once.
        if rank == 0:
            first = 0 if size == 1 else 1
            raise click.UsageError(f"--slow-rank {slow_rank}: the workers are ranks {first} to {size - 1}")
        sys.exit(2)
    compute = lambda item: work(item, seed, rows, cols)  # noqa: E731
    pause = delay if rank == slow_rank else 0.0
    started = time.perf_counter()
    if size == 1:
        results, counts = alone(items, compute, pause)
    elif rank == 0:
        results, counts = master(items, compute)
    else:
        results, counts = None, worker(compute, pause)
    elapsed = time.perf_counter() - started
    # Each worker's own count, to check against what the master saw.
    told = comm.gather_object(counts if rank > 0 else None, root=0)
    if rank != 0:
        return
    if size > 1 and told[1:] != [counts[w] for w in range(1, size)]:
        sys.exit(f"master_worker: the workers counted {told[1:]} items, the master {counts}")
    missing = [i for i in range(items) if i not in results]
    if missing or len(results) != items:
        sys.exit(f"master_worker: {len(missing)} of {items} items never came back (first: {missing[:5]})")
    expected = [compute(i) for i in range(items)]  # the serial recomputation
    wrong = [i for i in range(items) if results[i] != expected[i]]
    total, serial = sum(results[i] for i in range(items)), sum(expected)
    if wrong or total != serial:
        sys.exit(f"master_worker: {len(wrong)} of {items} results differ from the serial computation "
                 f"(first: {wrong[:5]}); total {total!r}, serial {serial!r}")
    if not quiet:
        per_worker = ", ".join(f"{w}: {c}" for w, c in sorted(counts.items()))
        print(f"master_worker: {items} items, per worker {{{per_worker}}}, total {total!r}, OK "
              f"({elapsed:.3f} s on {size} rank{'s' if size > 1 else ''})")


if __name__ == "__main__":
    run_command(main)  # a bad option: said once, every rank exits 2
