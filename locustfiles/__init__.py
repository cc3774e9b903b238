"""Locust load experiments for prefix-serve (one user class a workload; see README "Load testing").

``workloads`` holds the pure, seeded prompt generators; ``_common`` the streaming
OpenAI client and the Locust metrics (``_``: Locust skips it when ``-f`` names this folder).
"""
