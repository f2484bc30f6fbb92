"""Why one padded graph and not a cache of graphs: the packing keys of realistic batches, simulated on a CPU.

A CUDA graph of a packed FLA step is only valid for the sizes it was captured with: the document count ``N``
(grids of the state passes) and the chunk count ``NT = sum(ceil(len / 64))`` (grids of the chunk kernels, the
chunk-state tensors). A cache of graphs keyed by ``(N, NT)`` replays only when a key repeats; one graph with
``StaticSeqlens`` padded to a document bound replays every batch with at most ``max_docs`` documents.

This script packs documents drawn from a length distribution into ``T``-token batches, as concatenation
packing does (documents in order, the last one cut at the batch border and continued in the next batch),
and reports per distribution and ``T``: the quantiles of ``N``; the share of batches a graph cache of
``k`` entries (least recently used) would replay; the share a padded graph with bound ``max_docs`` covers;
and the padding that bound costs on average over the batches it covers: idle chunk rows, ``max_chunks / NT -
1`` (programs of the chunk kernels that load nothing and store nothing, but still run their tile's arithmetic
on zeros; the state passes loop over no chunk for a padding document).

    python -m benchmarks.graph_keys                       # the table of docs/graphs.md
    python -m benchmarks.graph_keys --batches 20000 --tokens 32768

Distributions (document lengths in tokens, log-normal, clipped to ``[1, 4T]``): ``short`` (median 250, SFT
chats), ``web`` (median 700, pretraining web text), ``long`` (median 3000, code and books). They are
illustrations, not measurements of a corpus; run it with your own lengths (``--lengths FILE``, one per line).
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics

import torch

from fla_ac_isolation.graphs import max_chunks_for

__all__ = ["DISTRIBUTIONS", "cache_hit_rate", "pack", "summarise"]

DISTRIBUTIONS = {"short": (math.log(250), 0.8), "web": (math.log(700), 1.2), "long": (math.log(3000), 1.0)}
CHUNK = 64


def _lengths(name: str, count: int, tokens: int, generator: torch.Generator) -> list[int]:
    mu, sigma = DISTRIBUTIONS[name]
    draws = torch.exp(mu + sigma * torch.randn(count, generator=generator, dtype=torch.float64))
    return [max(1, min(4 * tokens, round(x))) for x in draws.tolist()]


def pack(lengths: list[int], tokens: int, batches: int) -> list[list[int]]:
    """``batches`` packed batches of exactly ``tokens`` tokens: each a list of document pieces (concatenation
    packing: a document longer than the room left continues in the next batch). Reuses ``lengths`` cyclically."""
    out, current, room, i, left = [], [], tokens, 0, lengths[0]
    while len(out) < batches:
        piece = min(left, room)
        current.append(piece)
        room -= piece
        left -= piece
        if left == 0:
            i += 1
            left = lengths[i % len(lengths)]
        if room == 0:
            out.append(current)
            current, room = [], tokens
    return out


def cache_hit_rate(keys: list[tuple[int, int]], size: int) -> float:
    """Share of ``keys`` found in a least-recently-used cache of ``size`` entries (a miss captures a new graph)."""
    cache: collections.OrderedDict = collections.OrderedDict()
    hits = 0
    for key in keys:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = True
            if len(cache) > size:
                cache.popitem(last=False)
    return hits / len(keys)


def summarise(batches: list[list[int]], tokens: int, bounds: tuple[int, ...], sizes: tuple[int, ...]) -> dict:
    """The figures of the module docstring for ``batches`` of ``tokens`` tokens."""
    docs = [len(b) for b in batches]
    chunks = [sum(-(-n // CHUNK) for n in b) for b in batches]
    keys = list(zip(docs, chunks, strict=True))
    q = statistics.quantiles(docs, n=100, method="inclusive")
    return {
        "docs_p50": statistics.median(docs), "docs_p99": q[98], "docs_max": max(docs), "distinct_keys": len(set(keys)),
        "cache_hit_rate": {k: cache_hit_rate(keys, k) for k in sizes},
        "padded_covers": {b: sum(d <= b for d in docs) / len(docs) for b in bounds},
        "padding_overhead": {b: statistics.mean(max_chunks_for(tokens, b) / c - 1 for d, c in keys if d <= b)
                             if any(d <= b for d in docs) else None for b in bounds},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--bounds", nargs="+", type=int, default=[64, 128, 512])
    parser.add_argument("--cache-sizes", nargs="+", type=int, default=[4, 64])
    parser.add_argument("--lengths", help="a file of document lengths, one per line (instead of the distributions)")
    args = parser.parse_args(argv)
    sources = None
    if args.lengths:
        with open(args.lengths) as f:
            sources = {"file": [int(line) for line in f if line.strip()]}
    print("| lengths | T | N p50 / p99 / max | distinct (N, NT) | LRU cache hit rate | padded graph covers "
          "(max_docs) | idle chunk rows (max_docs) |")
    print("|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        for name in (sources or DISTRIBUTIONS):
            gen = torch.Generator().manual_seed(0)
            lengths = sources[name] if sources else _lengths(name, 200_000, tokens, gen)
            s = summarise(pack(lengths, tokens, args.batches), tokens, tuple(args.bounds), tuple(args.cache_sizes))
            cache = ", ".join(f"{k}: {100 * v:.1f} %" for k, v in s["cache_hit_rate"].items())
            covers = ", ".join(f"{b}: {100 * v:.1f} %" for b, v in s["padded_covers"].items())
            idle = ", ".join(f"{b}: {'-' if v is None else f'{100 * v:.0f} %'}"
                             for b, v in s["padding_overhead"].items())
            print(f"| {name} | {tokens} | {s['docs_p50']:.0f} / {s['docs_p99']:.0f} / {s['docs_max']} | "
                  f"{s['distinct_keys']} of {args.batches} | {cache} | {covers} | {idle} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
