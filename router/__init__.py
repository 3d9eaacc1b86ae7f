"""Routing requests to engine replicas (least outstanding work, prefix affinity); built with the Ray
Serve deployment."""
