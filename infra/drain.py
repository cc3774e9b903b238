"""Stop serving without cutting requests in flight: delete the app, let its replicas drain.

``python -m infra.drain`` (``make drain``), run beside ``make serve``, connects to the
running Ray cluster and deletes the Serve application (``prefix-serve`` by default)
with Ray's ``serve.delete``. Serve's HTTP proxy stays up while each replica of the
app finishes the requests it holds, streams included, for at most its
``graceful_shutdown_timeout_s`` (derived from ``lifecycle.request_timeout_s`` by
``app.builder``). From the start, the proxy answers new requests itself, with Serve's
plain-text 404 (``Path '/v1/models' not found. ...``), not OpenAI's JSON: the app no
longer exists to answer them. It returns once the replicas are gone. Then Ctrl-C in
the ``make serve`` terminal stops Ray.

Ctrl-C alone does not drain: ``serve run`` answers it with Ray's ``serve.shutdown()``,
which kills the HTTP proxies at once, so streams in flight end without ``[DONE]``
(the engines see them cancelled and free their blocks).

It connects as ``ray.init`` does (``RAY_ADDRESS``, else the cluster ``auto`` finds):
where several Ray clusters run on one machine, set ``RAY_ADDRESS`` (``--address``) to
``make serve``'s. It prints a line every 10 s while replicas drain.

Errors: exits 1 with a message when no Ray cluster is running or no app of that
name is deployed.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_APP = "prefix-serve"  # applications[0].name in serve_config.yaml


def drain(app_name: str = DEFAULT_APP, progress_every_s: float = 0.0) -> float:
    """Delete Serve application ``app_name`` from the connected Ray cluster once its
    replicas have drained; returns the seconds it took.

    Waits as long as the replicas drain (their ``graceful_shutdown_timeout_s`` bounds it),
    not Serve's own 60 s wait of a blocking ``serve.delete``, which gives up while a stream
    still runs. With ``progress_every_s`` > 0, a line says what still drains that often.

    Raises ``LookupError`` when no application of that name is deployed."""
    from ray import serve

    if app_name not in serve.status().applications:
        raise LookupError(f"no Serve application named {app_name!r} is deployed")
    start = time.monotonic()
    serve.delete(app_name, _blocking=False)
    said = start
    while (status := serve.status().applications.get(app_name)) is not None:
        now = time.monotonic()
        if progress_every_s > 0 and now - said >= progress_every_s:
            said = now
            print(f"drain: {now - start:.0f} s, {app_name!r} {str(status.status).rsplit('.', 1)[-1].lower()}",
                  flush=True)
        time.sleep(0.5)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", default=DEFAULT_APP, help="Serve application name (default: %(default)s)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: %(default)s)")
    args = parser.parse_args(argv)

    import ray

    try:
        ray.init(address=args.address, logging_level="ERROR")
    except ConnectionError as e:
        print(f"drain: no Ray cluster at {args.address!r} (is `make serve` running?): {e}", file=sys.stderr)
        return 1
    print(f"drain: deleting {args.app!r}; its replicas finish the requests they hold ...", flush=True)
    try:
        took = drain(args.app, progress_every_s=10.0)
    except LookupError as e:
        print(f"drain: {e}", file=sys.stderr)
        return 1
    print(f"drain: {args.app!r} deleted after {took:.1f} s; press Ctrl-C in the `make serve` terminal to stop Ray")
    return 0


if __name__ == "__main__":
    sys.exit(main())
