"""Cluster simulator: the project's routing code against simulated vLLM replicas.

``python -m bench.sim --trace FILE | --workload NAME ...`` (see :mod:`bench.sim.cli`)
replays a workload through each routing policy on a fresh simulated cluster and
reports hit rates, TTFT / ITL percentiles, throughput and load imbalance, with
two hit-rate bounds.  Results and commands: ``docs/benchmarks.md``.

One concept per module:

* :mod:`~bench.sim.latency` -- step-time model from FLOPs and bytes, RTX 4090 presets, KV capacity;
* :mod:`~bench.sim.block_pool` -- vLLM's block pool: prefix cache of full blocks, LRU free queue, KV events;
* :mod:`~bench.sim.replica` -- vLLM's scheduler: continuous batching, chunked prefill, admission, preemption;
* :mod:`~bench.sim.event_path` -- KV events to a router's ``BlockIndex`` through the wire format, after a lag;
* ``prefix_affinity`` runs :class:`routing.router_state.RouterState`, the live router's decision sequence without Ray;
* :mod:`~bench.sim.policies` -- the compared routing policies;
* :mod:`~bench.sim.cluster` -- the discrete-event loop of one policy run;
* :mod:`~bench.sim.workload`, :mod:`~bench.sim.trace`, :mod:`~bench.sim.generators` -- requests and tokens;
* :mod:`~bench.sim.bounds` -- pooled and unbounded cache hit rates;
* :mod:`~bench.sim.results`, :mod:`~bench.sim.plot` -- report numbers and figure;
* :mod:`~bench.sim.engine_check` -- the replica model against a real vLLM engine.

What runs unchanged from ``routing/``: ``block_keys``, the event structs with
``encode_batch`` / ``decode_batch`` (via ``encode_frames`` / ``decode_frames``),
``BlockIndex`` (``apply_batch``, ``match``, ``predict``, ``expire``) and
``choose_replica`` with ``PolicyConfig`` / ``ReplicaView`` / ``cached_tokens``.
"""
