"""Serving over several machines with Ray (`modelhost serve --cluster HEAD:6379`).

`secret` has no Ray in it (a worker imports it); `actors`, `membership` and `serve` import Ray,
and only `modelhost serve --cluster` imports them.
"""
