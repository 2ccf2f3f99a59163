"""Serving over several machines with Ray (`modelhost serve --cluster HEAD:6379`).

Like the command line, this package composes the layers (it serves the app of `cli_serve`), and
it is the only one that imports Ray: only `modelhost serve --cluster` imports it. The worker's
side of the cluster secret is `server/edge/cluster_secret.py`, Ray-free.
"""
