"""A stand-in for vLLM's ZmqEventPublisher, with pyzmq (libzmq) as vLLM uses
it: a PUB socket for live batches and a ROUTER socket that replays its buffer.

Replay protocol (vLLM's legacy form, which every release answers): the
client's DEALER sends [b"", start_seq (8 bytes, big-endian)]; the ROUTER
answers every buffered batch with seq >= start_seq as
[client, b"", topic, seq, payload] (vLLM >= 0.26; --old-format: without the
topic), then [client, b"", (b"",) END_SEQ, b""].

Usage: vllm_publisher.py --pub EP --router EP --frames FILE --pod NAME
                         [--buffer N] [--old-format]
Commands on stdin, one per line ("ok" on stdout after each):
  marker NAME       publish an empty batch on kv@NAME@warmup-model (not buffered)
  publish A B [skip S,S,...]
                    publish this pod's recorded batches A..B-1 (by position);
                    those whose seq is listed are only buffered, as if PUB had
                    dropped them
  quit
"""
import argparse
import base64
import json
import sys
import threading

import msgspec
import zmq

END_SEQ = (2**64 - 1).to_bytes(8, "big")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--router", required=True)
    ap.add_argument("--frames", required=True)
    ap.add_argument("--pod", required=True)
    ap.add_argument("--buffer", type=int, default=10000)
    ap.add_argument("--old-format", action="store_true")
    args = ap.parse_args()

    frames = []
    with open(args.frames) as f:
        for line in f:
            d = json.loads(line)
            if d["topic"].split("@")[1] == args.pod:
                frames.append((d["topic"].encode(), d["seq"], base64.b64decode(d["payload_b64"])))

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(args.pub)
    router = ctx.socket(zmq.ROUTER)
    router.bind(args.router)
    buffer = []  # (topic, seq, payload), oldest first
    lock = threading.Lock()

    def serve_replay():
        while True:
            try:
                frame = router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frame) != 3:
                continue
            client, _, start = frame
            start_seq = int.from_bytes(start, "big")
            with lock:
                items = [b for b in buffer if b[1] >= start_seq]
            for topic, seq, payload in items:
                head = [client, b""] if args.old_format else [client, b"", topic]
                router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
            tail = [client, b""] if args.old_format else [client, b"", b""]
            router.send_multipart(tail + [END_SEQ, b""])

    threading.Thread(target=serve_replay, daemon=True).start()
    empty = msgspec.msgpack.encode((0.0, [], 0))
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "marker":
            pub.send_multipart([f"kv@{parts[1]}@warmup-model".encode(), (0).to_bytes(8, "big"), empty])
        elif parts[0] == "publish":
            a, b = int(parts[1]), int(parts[2])
            skip = set()
            if len(parts) > 4 and parts[3] == "skip":
                skip = {int(s) for s in parts[4].split(",") if s}
            for topic, seq, payload in frames[a:b]:
                with lock:
                    buffer.append((topic, seq, payload))
                    del buffer[: max(0, len(buffer) - args.buffer)]
                if seq not in skip:
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        elif parts[0] == "quit":
            break
        print("ok", flush=True)
    pub.close(0)
    router.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
