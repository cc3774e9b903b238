"""Locust load experiments for prefix-serve (one user class a workload; see README "Load testing").

``shapes`` defines the workload shapes and the Mooncake reader (the simulator,
``bench/sim``, uses them too); ``workloads`` turns them into pure, seeded
requests and holds the options; ``_common`` the streaming
OpenAI client and the Locust metrics (``_``: Locust skips it when ``-f`` names this folder).
"""
