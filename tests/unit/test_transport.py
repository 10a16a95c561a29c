"""The embedded broker: a consumer polling the folder never sees a half-written message."""

from __future__ import annotations

import threading

import pytest
from kombu import Connection

import durable_celery.worker.transport  # noqa: F401  (registers durablefs://)


@pytest.mark.timeout(60)
def test_messages_written_while_consumed_arrive_whole(tmp_path):
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path / "control"),
        "polling_interval": 0.001,
    }
    per_producer, producers = 300, 3

    def produce(n: int) -> None:
        with Connection("durablefs://", transport_options=options) as conn:
            queue = conn.SimpleQueue("q")
            for i in range(per_producer):
                queue.put({"producer": n, "i": i, "pad": "x" * 2000})
            queue.close()

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
    received = []
    with Connection("durablefs://", transport_options=options) as conn:
        queue = conn.SimpleQueue("q")
        for t in threads:
            t.start()
        while len(received) < per_producer * producers:
            message = queue.get(timeout=20)
            received.append((message.payload["producer"], message.payload["i"]))
            message.ack()
        queue.close()
    for t in threads:
        t.join()
    assert sorted(received) == [(n, i) for n in range(producers) for i in range(per_producer)]
