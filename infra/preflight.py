"""Refuse to start a second Serve app on a port that is already served (make serve runs this first).

``python -m infra.preflight CONFIG [-- COMMAND ...]`` reads ``http_options`` (host and
port, Serve's defaults where unset) from the Serve config file ``CONFIG`` with Serve's
own schema, as ``serve run`` does, and exits 1 naming the cause when

* another ``make serve`` on the same port is running (it holds the port's lock file,
  ``<tmp>/prefix-serve-port-<port>.lock``), or
* something listens on that port already: a Serve proxy (named with the applications
  its ``GET /-/routes`` lists: ``prefix-serve`` is this project's app) or any other program.

Why: ``serve run`` starts a new local Ray cluster, whose Serve proxy binds the port
without an error even where another proxy listens on it (Serve sets ``SO_REUSEPORT``);
the kernel then splits connections between the two apps.

With ``-- COMMAND`` (``make serve``: ``-- .venv/bin/serve run CONFIG``) it takes the
port's lock before the port check and, once both pass, runs COMMAND, which shares the
lock until it exits; so a second ``make serve`` started while the first is still
starting (its proxy not yet bound) is refused too. A stop signal (Ctrl-C, or SIGTERM to
``make serve``'s process group) reaches COMMAND as one Ctrl-C, the way ``serve run``
shuts down quietly (``run_stopping_gently``). Without a command it only checks (exit 0:
the port is free).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra import ray_env

PROG = "preflight"


@dataclass(frozen=True)
class Listen:
    """Where the config's Serve proxy listens, and the applications it deploys."""

    config: str
    host: str
    port: int
    apps: tuple[str, ...]


def read_config(path: str) -> Listen:
    """``http_options`` of a Serve config file, validated by Serve's ``ServeDeploySchema``."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    with open(path, encoding="utf-8") as f:
        config = ServeDeploySchema.model_validate(yaml.safe_load(f))
    return Listen(path, config.http_options.host, config.http_options.port,
                  tuple(app.name for app in config.applications))


def lock_path(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"prefix-serve-port-{port}.lock"


def take_lock(listen: Listen) -> int | str:
    """The file descriptor holding the port's lock (``flock``), or, when another process
    holds it, what that process wrote there (its pid and config)."""
    fd = os.open(lock_path(listen.port), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 1024).decode(errors="replace").strip()
        os.close(fd)
        return holder or "a process that wrote nothing"
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}, config {os.path.abspath(listen.config)}".encode())
    return fd


def _client_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def port_taken(host: str, port: int) -> str | None:
    """Why ``(host, port)`` cannot be served, or None when it is free.

    Taken: binding it fails (with ``SO_REUSEADDR``, as servers bind, so a port left in
    TIME_WAIT by a server that just stopped counts as free; Linux still refuses a port a
    socket listens on), or a connection to it succeeds.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return e.strerror or str(e)
    try:
        with socket.create_connection((_client_host(host), port), timeout=1):
            return "a program accepts connections on it"
    except OSError:
        return None


def serve_routes(host: str, port: int) -> dict[str, str] | None:
    """The route table of the Serve proxy on ``(host, port)`` (``GET /-/routes``: route
    prefix -> application), or None when what answers there is not a Serve proxy."""
    client = _client_host(host)
    url = f"http://[{client}]:{port}/-/routes" if ":" in client else f"http://{client}:{port}/-/routes"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never an HTTP proxy
    try:
        with opener.open(url, timeout=3) as r:
            routes = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return routes if isinstance(routes, dict) else None


def refusal(listen: Listen) -> str | None:
    """The message saying why the config's port cannot be served now, or None if it can."""
    why = port_taken(listen.host, listen.port)
    if why is None:
        return None
    where = f"port {listen.port} on {listen.host or '*'} (http_options of {listen.config})"
    routes = serve_routes(listen.host, listen.port)
    if routes is None:
        return f"{where} is already in use: {why}. Stop that program or set another http_options.port."
    ours = sorted(set(routes.values()) & set(listen.apps))
    apps = ", ".join(f"{app!r} at {prefix!r}" for prefix, app in sorted(routes.items())) or "no application"
    running = f"{', '.join(map(repr, ours))} is already running there. " if ours else ""
    return (f"{where} is already served by a Ray Serve proxy ({apps}): {running}"
            "A second `serve run` would start another Ray cluster whose proxy binds the same port "
            "without an error (Serve sets SO_REUSEPORT), and requests would be split between the two. "
            "Stop the running one first (Ctrl-C in its terminal; `make drain` before it lets its requests "
            "finish), or set another http_options.port.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog=f"python -m infra.{PROG}", description=__doc__.splitlines()[0],
                                     usage="%(prog)s CONFIG [-- COMMAND ...]")
    parser.add_argument("config", help="Serve config file (serve_config.yaml shape)")
    args = parser.parse_args(argv)
    try:
        listen = read_config(args.config)
    except Exception as e:  # noqa: BLE001 - a missing file, bad YAML or a schema error: say which
        print(f"{PROG}: cannot read {args.config}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    lock = take_lock(listen) if command else None
    if isinstance(lock, str):
        print(f"{PROG}: another `make serve` on port {listen.port} is running ({lock}; lock file "
              f"{lock_path(listen.port)}). Stop it first (Ctrl-C in its terminal), or set another "
              f"http_options.port in {listen.config}.", file=sys.stderr)
        return 1
    message = refusal(listen)
    if message is not None:
        print(f"{PROG}: {message}", file=sys.stderr)
        return 1
    if lock is None:
        print(f"{PROG}: port {listen.port} on {listen.host or '*'} is free")
        return 0
    os.set_inheritable(lock, True)  # COMMAND keeps the lock until it exits
    ray_env.apply()  # the Ray cluster COMMAND starts runs the app's serving path (HAProxy, direct ingress)
    return run_stopping_gently(command, pass_fds=(lock,))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ESCALATE_AFTER_S = 3.0
"""A stop signal escalates only this long after the last one: one stop often arrives twice within
milliseconds (SIGTERM to make's process group reaches this process, and make passes its own on)."""


def run_stopping_gently(command: list[str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run ``command`` in a session of its own and stop it the way it stops cleanly: any of
    ``STOP_SIGNALS`` sent to this process (Ctrl-C, or SIGTERM to ``make serve``'s process group)
    becomes one SIGINT to the command's process group (``serve run`` shuts Serve and its Ray
    cluster down on Ctrl-C; on SIGTERM Ray prints a stack, ``SystemExit: 15`` and may abort in its
    teardown); a second such signal sends SIGTERM, a third SIGKILL, each only if it comes at least
    ``ESCALATE_AFTER_S`` after the last one passed on (one stop often arrives twice: from the
    process group's kill and from make, which passes its own SIGTERM on).

    Returns 0 when a requested stop ended the command quietly (exit 0, or by the SIGINT), else
    the command's status (a signal's as ``128 + signum``); 1 if it cannot start.
    """
    try:
        # SIGINT back to its default in the command: a background job of a non-interactive shell
        # inherits it ignored, and then Python's Ctrl-C handling (``serve run``'s shutdown) is off.
        child = subprocess.Popen(command, pass_fds=pass_fds, start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    except OSError as e:
        print(f"{PROG}: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 1
    escalation = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    asked: list[float] = []  # when each signal that was passed on came (time.monotonic)

    def stop(signum: int, _frame: object) -> None:
        now = time.monotonic()
        if asked and now - asked[-1] < ESCALATE_AFTER_S:
            return  # the same stop, delivered twice
        sent = escalation[min(len(asked), len(escalation) - 1)]
        asked.append(now)
        try:
            os.killpg(child.pid, sent)
        except ProcessLookupError:  # already gone
            pass

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    code = child.wait()  # a signal runs ``stop`` and the wait goes on (PEP 475)
    if asked and code in (0, -signal.SIGINT, 128 + signal.SIGINT):
        return 0
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
