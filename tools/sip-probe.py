#!/usr/bin/env python3
"""A hostile caller against a running `duplex serve` with SIP on: the three attacks of a public
SIP port whose cost is the server's memory, descriptors and log, and whether its RTP can be
aimed at a third party. Prints what it measured (the server's descriptors, resident memory and
log bytes before and after each; RTP packets that reached the third address). Used for the
figures of docs/serving.md; not a test (the tests assert what the code decides).

    tools/sip-probe.py --pid PID --log SERVE.LOG --port 5060 [--http 127.0.0.1:8998]
                       [--tcp 2000] [--options 20000] [--third 127.0.0.9]

Needs nothing but Python; run it on the server's machine (it reads /proc/PID).
"""

import argparse
import os
import socket
import sys
import time
import urllib.request


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def log_bytes(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def state(a):
    return {"fds": fds(a.pid), "rss_mb": round(rss_mb(a.pid), 1), "log_bytes": log_bytes(a.log)}


def healthz(http):
    try:
        with urllib.request.urlopen(f"http://{http}/healthz", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def tcp_flood(a):
    """Idle TCP connections from one address, as many as it takes (up to --tcp)."""
    before = state(a)
    conns, refused = [], 0
    for _ in range(a.tcp):
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(("127.0.0.1", a.port))
            conns.append(s)
        except OSError:
            refused += 1
            s.close()
    time.sleep(2)
    # Which of them the server still holds: a closed one reads EOF (or a reset) at once.
    open_ = 0
    for s in conns:
        s.setblocking(False)
        try:
            if s.recv(1) == b"":
                continue
        except BlockingIOError:
            open_ += 1
        except OSError:
            continue
    during = state(a)
    ok = healthz(a.http) if a.http else None
    for s in conns:
        s.close()
    return {"tried": a.tcp, "refused_at_connect": refused, "held_after_2s": open_,
            "before": before, "during": during, "healthz_during": ok}


INVITE = (
    "INVITE sip:duplex@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bK{call}\r\n"
    "From: <sip:p@{local}>;tag={call}\r\nTo: <sip:duplex@127.0.0.1>\r\nCall-ID: {call}\r\n"
    "CSeq: 1 INVITE\r\nContact: <sip:p@{local}>\r\nMax-Forwards: 70\r\n"
    "Content-Type: application/sdp\r\nContent-Length: {n}\r\n\r\n{body}"
)


def reflection(a):
    """An INVITE whose SDP names a third address: how many RTP packets reach it."""
    third = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    third.bind((a.third, 0))
    third.settimeout(0.2)
    tport = third.getsockname()[1]
    body = (f"v=0\r\no=- 1 1 IN IP4 {a.third}\r\ns=-\r\nc=IN IP4 {a.third}\r\nt=0 0\r\n"
            f"m=audio {tport} RTP/AVP 0\r\n")
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(3)
    local = "%s:%d" % s.getsockname()
    call = "refl%d" % int(time.time())
    msg = INVITE.format(local=local, call=call, n=len(body), body=body)
    s.sendto(msg.encode(), ("127.0.0.1", a.port))
    status, to = None, ""
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            got = s.recv(4096).decode(errors="replace")
        except socket.timeout:
            break
        first = got.split("\r\n", 1)[0]
        if first.startswith("SIP/2.0 1"):
            continue
        status = first
        to = next((l for l in got.split("\r\n") if l.lower().startswith("to:")), "")
        break
    if status and " 200 " in status + " ":
        ack = (f"ACK sip:duplex@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bK{call}a\r\n"
               f"From: <sip:p@{local}>;tag={call}\r\n{to}\r\nCall-ID: {call}\r\nCSeq: 1 ACK\r\n"
               "Max-Forwards: 70\r\nContent-Length: 0\r\n\r\n")
        s.sendto(ack.encode(), ("127.0.0.1", a.port))
    got, t0 = 0, time.time()
    while time.time() - t0 < a.seconds:
        try:
            third.recv(2048)
            got += 1
        except socket.timeout:
            pass
    return {"answer": status, "packets_to_third_address": got, "seconds": a.seconds}


def options_flood(a):
    """Out-of-dialog OPTIONS, each a new transaction, as fast as one socket sends them."""
    before = state(a)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    local = "%s:%d" % s.getsockname()
    t0 = time.time()
    for i in range(a.options):
        msg = (f"OPTIONS sip:duplex@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP {local};branch=z9hG4bKo{i}\r\n"
               f"From: <sip:p@{local}>;tag=o{i}\r\nTo: <sip:duplex@127.0.0.1>\r\nCall-ID: o{i}\r\n"
               "CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n")
        try:
            s.sendto(msg.encode(), ("127.0.0.1", a.port))
        except BlockingIOError:
            time.sleep(0.001)
        if i % 500 == 0:
            while True:
                try:
                    s.recv(4096)
                except BlockingIOError:
                    break
    sent_s = time.time() - t0
    time.sleep(3)
    return {"sent": a.options, "in_s": round(sent_s, 1), "before": before, "after": state(a)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--port", type=int, default=5060)
    p.add_argument("--http", default="")
    p.add_argument("--tcp", type=int, default=2000)
    p.add_argument("--options", type=int, default=20000)
    p.add_argument("--third", default="127.0.0.9")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    for name, f in [("tcp", tcp_flood), ("reflection", reflection), ("options", options_flood)]:
        print(name, f(a), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
