"""How long a request note takes from one coordinator to another, through a real Redis.

Usage: python benchmarks/note_trip.py [--num-notes 300] [--interval-ms 10] [--json PATH]

One coordinator's `NoteSender` queues a `RequestTaken` note (as routing does) every interval;
another's `IndexStore` is blocked reading the shard streams (as its follower is). Printed: the
trip from `send` to the reader holding the decoded note, p50 / p90 / p99. This is the delay the
simulator's `--note-delay-ms` stands for.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from kvmesh.coordinator.cluster.redis_server import start_redis_server
from kvmesh.coordinator.index.note_sender import NoteSender
from kvmesh.coordinator.index.store import IndexStore
from kvmesh.proto.request_notes import NoteBatch, RequestTaken


def measure(redis_url: str, num_notes: int, interval_s: float) -> list[float]:
    sender_store, reader_store = IndexStore(redis_url), IndexStore(redis_url)
    sender = NoteSender(sender_store)
    sender.start()
    sent_at: dict[str, float] = {}
    trips_s: list[float] = []
    done = threading.Event()

    def read() -> None:
        after = reader_store.last_stream_ids()
        while not done.is_set():
            for entry in reader_store.read_stream(after, 100):
                after[entry.stream] = entry.entry_id
                for note in entry.notes.notes if entry.notes is not None else ():
                    trips_s.append(time.perf_counter() - sent_at[note.request_id])

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.3)  # the reader is blocked on the streams
    for i in range(num_notes):
        rid = f"r{i}"
        sent_at[rid] = time.perf_counter()
        sender.send(NoteBatch(f"w{i % 8}", (RequestTaken(rid, "c0", 2048, 1024),)))
        time.sleep(interval_s)
    time.sleep(0.5)
    done.set()
    reader.join()
    sender.stop()
    return sorted(trips_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-notes", type=int, default=300)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = start_redis_server()
    try:
        trips = measure(server.url, args.num_notes, args.interval_ms / 1e3)
    finally:
        server.stop()
    pct = {q: 1e3 * trips[min(len(trips) - 1, int(q / 100 * len(trips)))] for q in (50, 90, 99)}
    print(f"notes {len(trips)}/{args.num_notes}: trip p50 {pct[50]:.2f} ms, p90 {pct[90]:.2f} ms,"
          f" p99 {pct[99]:.2f} ms")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"num_notes": len(trips), **{f"trip_p{q}_ms": v for q, v in pct.items()}}
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
