#!/usr/bin/env python3
"""The soak of `lockstep serve` (run by scripts/soak-serve.sh, which starts the server).

While a steady load of small completions runs, it sends waves of abuse: stalled streams
and idle or half-sent connections held through the wave, and meanwhile rounds of
malformed and extreme requests, cut streams and whole answers, and half-closes.
Throughout, a probe asks for /health on a fresh connection every 50 ms and the server's
resident memory is sampled. The warm-up fills every rank's KV cache and runs one wave
(a long-running server's state, and its allocator's high-water mark for each kind of
abuse); then the abuse waves; then the steady load alone lets the server settle. It
checks: every /health answered within 100 ms; the resident memory back within 10 % of
what it was after the warm-up; /metrics accounting for every request accepted
(completed + failed + cancelled = submitted, and each outcome as expected: the stalled
and cut ones cancelled, the rest completed, none failed); every stalled stream closed by
the write timeout; every malformed request refused with its 4xx; every idle connection
closed by the server. Loopback only; exits non-zero on any failure.

Usage: soak-serve.py HOST:PORT SERVER_PID [--warmup-s 45] [--wave-s 25] [--waves 2]
       [--settle-s 20] [--stalled 16] [--idle 200] [--only stalled,idle,...]
"""

import argparse
import http.client
import json
import random
import socket
import struct
import sys
import threading
import time

HEALTH_LIMIT_S = 0.100
RSS_TOLERANCE = 0.10

p = argparse.ArgumentParser()
p.add_argument("addr")
p.add_argument("pid", type=int)
p.add_argument("--warmup-s", type=float, default=45)
p.add_argument("--wave-s", type=float, default=25)
p.add_argument("--waves", type=int, default=2)
p.add_argument("--settle-s", type=float, default=20)
p.add_argument("--steady-clients", type=int, default=6)
p.add_argument("--stalled", type=int, default=16)
p.add_argument("--idle", type=int, default=200)
p.add_argument("--fill", type=int, default=40)
PARTS = ["stalled", "idle", "malformed", "cut", "half-closed", "extreme"]
p.add_argument("--only", default=",".join(PARTS), help="the parts of the abuse to run: " + ",".join(PARTS))
args = p.parse_args()
only = set(filter(None, args.only.split(",")))
assert only <= set(PARTS), f"--only: parts are {PARTS}"
HOST, PORT = args.addr.split(":")
PORT = int(PORT)
assert HOST in ("127.0.0.1", "localhost", "::1"), "loopback only"

lock = threading.Lock()
count = {}  # what the client sent and saw, by name
problems = []  # what went wrong, in words
stop = threading.Event()


def bump(name, n=1):
    with lock:
        count[name] = count.get(name, 0) + n


def problem(what):
    with lock:
        problems.append(what)
    print(f"  problem: {what}", flush=True)


def connect(timeout=30):
    s = socket.create_connection((HOST, PORT), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def request_bytes(path, body, method="POST", extra=""):
    if isinstance(body, str):
        body = body.encode()
    return (
        f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def read_answer(s, deadline_s=60):
    """Reads one HTTP/1.1 answer (Content-Length or chunked, or to the end): its status
    and body; status 0 if the connection closed before a status line."""
    s.settimeout(deadline_s)
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            d = s.recv(65536)
            if not d:
                return 0, buf
            buf += d
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(rest) < n:
                d = s.recv(65536)
                if not d:
                    break
                rest += d
            return status, rest[:n]
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while not rest.endswith(b"0\r\n\r\n"):
                d = s.recv(65536)
                if not d:
                    break
                rest += d
            return status, dechunk(rest)
        while True:
            d = s.recv(65536)
            if not d:
                return status, rest
            rest += d
    except (socket.timeout, ConnectionError, OSError):
        return -1, buf


def dechunk(b):
    out = b""
    while True:
        size, _, b = b.partition(b"\r\n")
        try:
            n = int(size, 16)
        except ValueError:
            return out
        if n == 0:
            return out
        out += b[:n]
        b = b[n + 2 :]


def words(n):
    return " ".join(random.choice(["the", "quick", "brown", "fox", "jumps"]) for _ in range(n))


def metrics():
    c = http.client.HTTPConnection(HOST, PORT, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    m = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            m[name] = float(value)
    return m


def rss_kb():
    with open(f"/proc/{args.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# --- the probes ---------------------------------------------------------------------

health = []  # (t, seconds)
rss = []  # (t, kB)
T0 = time.monotonic()


def probe_health():
    while not stop.is_set():
        t = time.monotonic()
        try:
            s = connect(timeout=5)
            s.sendall(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
            status, _ = read_answer(s, 5)
            s.close()
        except OSError as e:
            status = f"{e}"
        took = time.monotonic() - t
        with lock:
            health.append((t - T0, took))
        if status != 200:
            problem(f"/health at {t - T0:.1f} s: {status}")
        elif took > HEALTH_LIMIT_S:
            problem(f"/health at {t - T0:.1f} s took {took * 1000:.1f} ms")
        time.sleep(max(0.0, 0.05 - (time.monotonic() - t)))


def sample_rss():
    while not stop.is_set():
        with lock:
            rss.append((time.monotonic() - T0, rss_kb()))
        time.sleep(0.5)


# --- the steady load -----------------------------------------------------------------


def steady(i):
    c = http.client.HTTPConnection(HOST, PORT, timeout=60)
    n = 0
    while not stop.is_set():
        n += 1
        stream = (n + i) % 2 == 0
        chat = (n + i) % 3 == 0
        max_tokens = random.randint(8, 64)
        if chat:
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": words(random.randint(4, 200))}]}
        else:
            path = "/v1/completions"
            body = {"prompt": words(random.randint(4, 200))}
        body.update({"max_tokens": max_tokens, "stream": stream})
        bump("steady submitted")
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = c.getresponse()
            text = r.read().decode()
        except (OSError, http.client.HTTPException) as e:
            problem(f"steady request: {e!r}")
            c.close()
            c = http.client.HTTPConnection(HOST, PORT, timeout=60)
            continue
        ok = r.status == 200 and (
            text.endswith("data: [DONE]\n\n") if stream else json.loads(text)["usage"]["completion_tokens"] == max_tokens
        )
        if ok:
            bump("steady completed")
        else:
            problem(f"steady request answered {r.status}: {text[:200]}")


# --- malformed and extreme requests ----------------------------------------------------

C = "/v1/completions"
CHAT = "/v1/chat/completions"
MALFORMED = [
    ("not JSON", request_bytes(C, "{"), {400}),
    ("a JSON array", request_bytes(C, "[]"), {400}),
    ("null", request_bytes(C, "null"), {400}),
    ("invalid UTF-8", request_bytes(C, b'{"prompt": "\xff\xfe", "max_tokens": 2}'), {400}),
    ("nested 100,000 deep", request_bytes(C, "[" * 100_000 + "]" * 100_000), {400}),
    ("prompt a number", request_bytes(C, '{"prompt": 5}'), {400}),
    ("no prompt", request_bytes(C, '{"max_tokens": 2}'), {400}),
    ("max_tokens -1", request_bytes(C, '{"prompt": "a", "max_tokens": -1}'), {400}),
    ("max_tokens 1e30", request_bytes(C, '{"prompt": "a", "max_tokens": 1e30}'), {400}),
    ("max_tokens a string", request_bytes(C, '{"prompt": "a", "max_tokens": "ten"}'), {400}),
    ("temperature -1", request_bytes(C, '{"prompt": "a", "temperature": -1}'), {400}),
    ("n 0", request_bytes(C, '{"prompt": "a", "n": 0}'), {400}),
    ("logprobs past 20", request_bytes(C, '{"prompt": "a", "logprobs": 21}'), {400}),
    ("five stop strings", request_bytes(C, '{"prompt": "a", "stop": ["a","b","c","d","e"]}'), {400}),
    ("a 2,000-byte stop string", request_bytes(C, json.dumps({"prompt": "a", "stop": "x" * 2000})), {400}),
    ("a bad chat role", request_bytes(CHAT, '{"messages": [{"role": "robot", "content": "hi"}]}'), {400}),
    ("no messages", request_bytes(CHAT, '{"messages": []}'), {400}),
    ("another model", request_bytes(C, '{"prompt": "a", "model": "gpt-nope"}'), {404}),
    ("a prompt over --max-prompt-tokens", request_bytes(C, json.dumps({"prompt": words(40_000)})), {400}),
    ("more KV than a rank has", request_bytes(C, '{"prompt": "a", "max_tokens": 1000000}'), {400}),
    (
        "a declared body over --max-body-bytes",
        f"POST {C} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 5000000\r\n\r\n{{".encode(),
        {413},
    ),
    (
        "a chunked body over --max-body-bytes",
        f"POST {C} HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        + b"".join(b"10000\r\n" + b" " * 0x10000 + b"\r\n" for _ in range(20))
        + b"0\r\n\r\n",
        {413},
    ),
    ("a garbage request line", b"GARBAGE\r\n\r\n", {400}),
    ("a 100 kB header", f"GET /health HTTP/1.1\r\nX-Big: {'a' * 100_000}\r\n\r\n".encode(), {400, 431}),
    ("an unknown route", request_bytes("/v1/nope", "{}"), {404}),
    ("GET on a POST route", f"GET {C} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode(), {404, 405}),
]


def malformed():
    for name, raw, want in MALFORMED:
        try:
            s = connect()
            s.sendall(raw)
        except OSError as e:
            # The server may close on a head it refuses before reading it all.
            status = f"sending: {e}"
        else:
            status, _ = read_answer(s, 20)
            s.close()
        bump("malformed sent")
        if status in want:
            bump("malformed refused as expected")
        else:
            problem(f"malformed ({name}): got {status}, expected {sorted(want)}")


def body_cut_short():
    """Headers promising 100 bytes, 10 sent, then the end: no request is accepted."""
    s = connect()
    s.sendall(f"POST {C} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 100\r\n\r\n{{\"prompt\":".encode())
    s.close()
    bump("body cut short")


def whole_ok(path, body, want_tokens):
    s = connect(timeout=120)
    s.sendall(request_bytes(path, json.dumps(body)))
    bump("submitted (expect completed)")
    status, text = read_answer(s, 120)
    s.close()
    try:
        ok = status == 200 and json.loads(text)["usage"]["completion_tokens"] == want_tokens
    except ValueError:
        ok = False
    if not ok:
        problem(f"extreme request answered {status}: {text[:200]!r}")


def extreme():
    # The longest prompts taken, in words and in token ids; a long output.
    whole_ok(C, {"prompt": words(32_000), "max_tokens": 4}, 4)
    whole_ok(C, {"prompt": list(range(32_000)), "max_tokens": 4}, 4)
    whole_ok(C, {"prompt": "a b", "max_tokens": 4000}, 4000)
    whole_ok(CHAT, {"messages": [{"role": "user", "content": words(20_000)}], "max_tokens": 4}, 4)


def half_closed():
    s = connect(timeout=60)
    s.sendall(request_bytes(C, json.dumps({"prompt": "a b", "max_tokens": 200})))
    s.shutdown(socket.SHUT_WR)
    bump("submitted (expect completed)")
    status, text = read_answer(s, 60)
    s.close()
    try:
        ok = status == 200 and json.loads(text)["usage"]["completion_tokens"] == 200
    except ValueError:
        ok = False
    if not ok:
        problem(f"half-closed request answered {status}: {text[:200]!r}")


def cut(stream, reset):
    """A long request whose client leaves: after the first event of a stream, or while
    a whole answer is generated; with an end of file or a reset."""
    s = connect()
    s.sendall(request_bytes(C, json.dumps({"prompt": "a b c", "max_tokens": 100_000, "stream": stream})))
    bump("submitted (expect cancelled)")
    if stream:
        s.recv(4096)
    else:
        time.sleep(0.3)
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def stall():
    """Streams whose client never reads: the server must cut them off."""
    socks = []
    for _ in range(args.stalled):
        s = connect()
        s.sendall(request_bytes(C, json.dumps({"prompt": "a b", "max_tokens": 50_000, "stream": True})))
        bump("submitted (expect cancelled)")
        bump("stalled")
        socks.append(s)
    return socks


def idle():
    """Connections that send nothing, or half a head: the server must close them."""
    socks = []
    for i in range(args.idle):
        s = connect()
        if i % 2:
            s.sendall(f"POST {C} HTTP/1.1\r\nHost: {HOST}\r\nContent-Le".encode())
        socks.append(s)
    bump("idle connections", args.idle)
    return socks


def wave(seconds):
    """One wave of abuse: stalled streams and idle connections opened at its start and
    held to its end, and rounds of the rest meanwhile."""
    stalled = stall() if "stalled" in only else []
    idled = idle() if "idle" in only else []
    end = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < end:
        rounds += 1
        if "malformed" in only:
            malformed()
            body_cut_short()
        if "cut" in only:
            for stream in (True, False):
                for reset in (False, True):
                    cut(stream, reset)
        if "half-closed" in only:
            half_closed()
        if "extreme" in only and rounds % 3 == 1:
            extreme()
        time.sleep(1)
    bump("abuse rounds", rounds)
    # The idle connections must have been closed by the server (a 408, or the end).
    still_open = 0
    for s in idled:
        s.settimeout(0.5)
        try:
            while s.recv(4096):
                pass
        except socket.timeout:
            still_open += 1
        except OSError:
            pass
        s.close()
    if still_open:
        problem(f"{still_open} of {len(idled)} idle connections still open after {seconds:.0f} s")
    for s in stalled:
        s.close()


def in_thread(f, *a):
    t = threading.Thread(target=f, args=a, daemon=True)
    t.start()
    t.join(600)
    if t.is_alive():
        problem(f"{f.__name__} did not finish")


# --- the run -------------------------------------------------------------------------

threads = [threading.Thread(target=probe_health, daemon=True), threading.Thread(target=sample_rss, daemon=True)]
threads += [threading.Thread(target=steady, args=(i,), daemon=True) for i in range(args.steady_clients)]
for t in threads:
    t.start()
# A server that has run a while has every rank's KV cache full of cached prefixes, and
# its allocator has seen each kind of abuse once: the memory to come back to is that of
# such a server, not of a fresh one (glibc keeps what an arena once held).
print(
    f"warm-up: {args.steady_clients} clients of steady load for {args.warmup_s:.0f} s; "
    f"{args.fill} prompts of 32,000 random token ids to fill every rank's KV cache; "
    f"then a first wave of abuse for {args.wave_s:.0f} s",
    flush=True,
)
warm_end = time.monotonic() + args.warmup_s
for _ in range(args.fill):
    whole_ok(C, {"prompt": [random.randrange(100_000) for _ in range(32_000)], "max_tokens": 1}, 1)
rss_fresh = rss_kb()
print(f"resident memory with the KV caches full: {rss_fresh / 1024:.1f} MB", flush=True)
in_thread(wave, args.wave_s)
time.sleep(max(0.0, warm_end - time.monotonic()))
rss_start = rss_kb()
print(f"resident memory after the warm-up: {rss_start / 1024:.1f} MB", flush=True)
print(
    f"abuse: {args.waves} waves of {args.wave_s:.0f} s, each {args.stalled} stalled streams, {args.idle} idle "
    f"connections, and rounds of {len(MALFORMED)} malformed requests, cut streams and answers, half-closes, "
    f"extreme requests",
    flush=True,
)
for _ in range(args.waves):
    in_thread(wave, args.wave_s)
print(f"settling for {args.settle_s:.0f} s (the steady load goes on)", flush=True)
time.sleep(args.settle_s)
stop.set()
for t in threads[2:]:
    t.join(120)
rss_end = rss_kb()
with lock:
    rss_peak = max(kb for _, kb in rss)

# Every request has ended: nothing running, waiting or holding a place.
deadline = time.monotonic() + 60
while True:
    m = metrics()
    busy = m["lockstep_num_requests_running"] + m["lockstep_num_requests_waiting"] + m["lockstep_num_requests_pending"]
    if busy == 0 or time.monotonic() > deadline:
        break
    time.sleep(0.2)
if busy:
    problem(f"requests still running, waiting or pending after the load: {busy:.0f}")

success = m["lockstep_request_success_total"]
failure = m["lockstep_request_failure_total"]
cancelled = m["lockstep_request_cancelled_total"]
stalled = m["lockstep_request_stalled_total"]
expect_completed = count.get("steady submitted", 0) + count.get("submitted (expect completed)", 0)
expect_cancelled = count.get("submitted (expect cancelled)", 0)
submitted = expect_completed + expect_cancelled

with lock:
    probes = [s for _, s in health]
probes.sort()
over = sum(1 for s in probes if s > HEALTH_LIMIT_S)
print()
print("== soak of lockstep serve")
for k in sorted(count):
    print(f"  {k}: {count[k]}")
print(
    f"/health: {len(probes)} probes (a fresh connection every 50 ms), median {probes[len(probes) // 2] * 1000:.2f} ms, "
    f"p99 {probes[int(len(probes) * 0.99)] * 1000:.2f} ms, max {probes[-1] * 1000:.2f} ms, over 100 ms: {over}"
)
print(
    f"resident memory: {rss_fresh / 1024:.1f} MB with the KV caches full, {rss_start / 1024:.1f} MB after the "
    f"warm-up's wave, {rss_peak / 1024:.1f} MB at the peak, "
    f"{rss_end / 1024:.1f} MB at the end ({(rss_end / rss_start - 1) * 100:+.1f} %)"
)
with lock:
    timeline = [f"{t:.0f} s {kb / 1024:.1f}" for t, kb in rss if int(t * 2) % 20 == 0]
print(f"resident memory (MB) every 10 s: {', '.join(timeline)}")
print(
    f"/metrics: completed {success:.0f} + failed {failure:.0f} + cancelled {cancelled:.0f} = "
    f"{success + failure + cancelled:.0f}; submitted {submitted} (expected completed {expect_completed}, "
    f"cancelled {expect_cancelled}); stalled streams closed {stalled:.0f}; 429s "
    f"{m['lockstep_request_rejected_total']:.0f}"
)

if over:
    problem(f"{over} /health probes took over 100 ms")
if rss_end > rss_start * (1 + RSS_TOLERANCE):
    problem(f"resident memory ended {(rss_end / rss_start - 1) * 100:.1f} % above its start")
if success + failure + cancelled != submitted:
    problem(f"/metrics accounts for {success + failure + cancelled:.0f} requests, {submitted} were submitted")
if (success, failure, cancelled) != (expect_completed, 0, expect_cancelled):
    problem(
        f"outcomes: completed {success:.0f} / failed {failure:.0f} / cancelled {cancelled:.0f}, "
        f"expected {expect_completed} / 0 / {expect_cancelled}"
    )
if stalled != count.get("stalled", 0):
    problem(f"{stalled:.0f} stalled streams closed, {count.get('stalled', 0)} stalled")
if m["lockstep_request_rejected_total"]:
    problem("requests were refused with 429")
if count.get("malformed refused as expected", 0) != count.get("malformed sent", 0):
    problem("malformed requests were not all refused as expected")

if problems:
    print(f"FAIL: {len(problems)} problems")
    sys.exit(1)
print("PASS")
