"""CPU per message of dial mode's receiving threads (the dial thread and
libzmq's I/O threads, which share its name), over real ZeroMQ sockets.

    python3 benches/dial_cpu.py target/release/kv-indexer 24 20000 8

binds 88 PUB sockets on loopback (the peer bench's pod count), starts the
service dialing all of them (`--zmq-bind none --zmq-connect ...`), then
publishes one-block vLLM batches (map form, as vLLM 0.24+ writes them)
round-robin from the first 24 pods at 20,000 messages/s for 8 s, and prints
the `zmq-dial` threads' CPU time (from /proc) over the messages the service
counted (`kv_indexer_messages_received_total`). Needs pyzmq and msgpack.
Loopback only; no Hub access (HF_HUB_OFFLINE=1).
"""
import os, sys, time, subprocess, struct, socket, re, urllib.request
import zmq, msgpack
binary = sys.argv[1]; active = int(sys.argv[2]); rate = int(sys.argv[3]); secs = float(sys.argv[4])
NPODS = 88
ctx = zmq.Context()
socks, ports = [], []
for i in range(NPODS):
    s = ctx.socket(zmq.PUB); s.setsockopt(zmq.SNDHWM, 100000)
    p = s.bind_to_random_port("tcp://127.0.0.1"); socks.append(s); ports.append(p)
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
grpc, met = free(), free()
args = [binary, "--grpc-addr", f"127.0.0.1:{grpc}", "--metrics-addr", f"127.0.0.1:{met}", "--zmq-bind", "none", "--log-level", "warn"]
for p in ports: args += ["--zmq-connect", f"tcp://127.0.0.1:{p}"]
env = dict(os.environ, HF_HUB_OFFLINE="1")
proc = subprocess.Popen(args, env=env)
time.sleep(3)
def ticks():
    out = {}
    for t in os.listdir(f"/proc/{proc.pid}/task"):
        try:
            comm = open(f"/proc/{proc.pid}/task/{t}/comm").read().strip()
            f = open(f"/proc/{proc.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[comm] = out.get(comm, 0) + int(f[11]) + int(f[12])
        except FileNotFoundError: pass
    return out
def received():
    m = urllib.request.urlopen(f"http://127.0.0.1:{met}/metrics").read().decode()
    v = re.search(r"^kv_indexer_messages_received_total (\S+)", m, re.M)
    return float(v.group(1)) if v else -1
seq = [0]*NPODS
def msg(pod):
    h = seq[pod] + 1 + pod * 10**9
    ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU"}
    return [f"kv@pod-{pod}@m".encode(), struct.pack(">Q", seq[pod]), msgpack.packb([time.time(), [ev], 0])]
t0 = ticks(); r0 = received(); start = time.time(); sent = 0
interval = 1.0 / rate
while time.time() - start < secs:
    target = int((time.time() - start) * rate)
    while sent < target:
        pod = sent % active
        socks[pod].send_multipart(msg(pod)); seq[pod] += 1; sent += 1
    time.sleep(0.0005)
time.sleep(1.5)
t1 = ticks(); r1 = received()
proc.terminate(); proc.wait()
d = {k: t1.get(k, 0) - t0.get(k, 0) for k in t1}
n = r1 - r0
print(f"sent {sent} received {n:.0f}; zmq-dial {d.get('zmq-dial',0)*10} ms = {d.get('zmq-dial',0)*1e4/max(n,1):.2f} us/msg; ingest {sum(v for k,v in d.items() if k.startswith('ingest'))*10} ms")
