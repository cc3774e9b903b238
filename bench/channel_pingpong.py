"""What one message between two processes costs: a ZMQ PUSH/PULL pair against asyncio's TCP transports.

The stream channel (``app.stream_channel``) carries a streamed answer's items from the engine
replica's event loop to the ingress's. Its first form was a ZMQ socket pair read on the loop
(``add_reader`` on ZMQ's FD, as the inbox did); it is now a TCP connection on both loops'
own transports. This runs a ping-pong of ``--size``-byte messages between two processes, each
side on ``uvloop`` (the replicas' loop), and prints, per round trip, the wall time and each
process's CPU time (all its threads: ZMQ's I/O thread included).

    python -m bench.channel_pingpong [--rounds 5000] [--size 100] [--repeat 2]

Two free ports on 127.0.0.1 are taken for each run. One run on a shared machine: read the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from typing import Any


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _zmq_side(role: str, rounds: int, size: int, ports: tuple[int, int]) -> dict[str, float]:
    import zmq

    ctx: zmq.Context = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    mine, theirs = ports if role == "a" else ports[::-1]
    pull.bind(f"tcp://127.0.0.1:{mine}")
    push.connect(f"tcp://127.0.0.1:{theirs}")
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes] = asyncio.Queue()

    def drain() -> None:  # ZMQ's FD signals edges: read until empty
        while True:
            try:
                inbox.put_nowait(pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return

    loop.add_reader(pull.fileno(), drain)
    await asyncio.sleep(1.0)  # both sides connected
    msg = b"x" * size
    return await _rounds(role, rounds, lambda: push.send(msg), inbox, drain)


class _Reader(asyncio.Protocol):
    def __init__(self, inbox: asyncio.Queue[bytes]):
        self.inbox = inbox

    def data_received(self, data: bytes) -> None:
        self.inbox.put_nowait(data)


async def _tcp_side(role: str, rounds: int, size: int, ports: tuple[int, int]) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[bytes] = asyncio.Queue()
    mine, theirs = ports if role == "a" else ports[::-1]
    await loop.create_server(lambda: _Reader(inbox), "127.0.0.1", mine)
    for _ in range(100):  # until the other side listens (10 s at most)
        try:
            transport, _ = await loop.create_connection(lambda: _Reader(asyncio.Queue()), "127.0.0.1", theirs)
            break
        except OSError:
            await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"nothing listens on 127.0.0.1:{theirs}")
    await asyncio.sleep(0.5)  # the other side connected too
    msg = b"x" * size
    return await _rounds(role, rounds, lambda: transport.write(msg), inbox, None)


async def _rounds(role: str, rounds: int, send: Any, inbox: asyncio.Queue[bytes], poll: Any) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    c0, t0 = _cpu_s(), time.perf_counter()
    for _ in range(rounds):
        if role == "a":
            send()
        if poll is not None:
            loop.call_soon(poll)  # a message that came before the reader was armed
        await inbox.get()
        if role == "b":
            send()
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return {"rtt_us": wall / rounds * 1e6, "cpu_us_per_round": cpu / rounds * 1e6}


def _side(mode: str, role: str, rounds: int, size: int, ports: tuple[int, int]) -> None:
    import uvloop

    uvloop.install()
    side = _zmq_side if mode == "zmq" else _tcp_side
    print(json.dumps(asyncio.run(side(role, rounds, size, ports))), flush=True)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run(mode: str, rounds: int, size: int) -> dict[str, float]:
    """One ping-pong of ``rounds`` round trips: ``rtt_us`` and ``cpu_us_per_round`` of each side.

    Raises:
        subprocess.CalledProcessError, subprocess.TimeoutExpired: a side failed or hung (both are stopped).
    """
    p1, p2 = _free_ports(2)
    cmd = [sys.executable, "-m", "bench.channel_pingpong", "--rounds", str(rounds), "--size", str(size),
           "--ports", str(p1), str(p2), "--side", mode]
    b = subprocess.Popen([*cmd, "b"], stdout=subprocess.PIPE, text=True)
    try:
        a = subprocess.run([*cmd, "a"], stdout=subprocess.PIPE, text=True, check=True, timeout=120)
        out_b, _ = b.communicate(timeout=120)
    finally:
        if b.poll() is None:
            b.kill()
            b.wait()
    ra, rb = json.loads(a.stdout), json.loads(out_b)
    return {"rtt_us": ra["rtt_us"], "cpu_us_a": ra["cpu_us_per_round"], "cpu_us_b": rb["cpu_us_per_round"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5000)
    ap.add_argument("--size", type=int, default=100, help="bytes a message")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each, alternating")
    ap.add_argument("--ports", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--side", nargs=2, metavar=("MODE", "ROLE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        _side(args.side[0], args.side[1], args.rounds, args.size, tuple(args.ports))
        return 0
    print(f"{'':5s} {'round trip (µs)':>16s} {'CPU a (µs)':>11s} {'CPU b (µs)':>11s}")
    for i in range(args.repeat):
        for mode in ("zmq", "tcp"):
            r = run(mode, args.rounds, args.size)
            print(f"{mode:5s} {r['rtt_us']:16.1f} {r['cpu_us_a']:11.1f} {r['cpu_us_b']:11.1f}   (run {i + 1})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
