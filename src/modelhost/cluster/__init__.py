"""Serving over several machines with Ray (`modelhost serve --cluster HEAD:6379`).

It sits just under the assembly (`assembly.serve_cluster` hands it the worker launch and the
app a single machine serves), and it is the only package that imports Ray: only `modelhost serve
--cluster` imports it. The worker's side of the cluster secret is
`server/edge/cluster_secret.py`, Ray-free.
"""
